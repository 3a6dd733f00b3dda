"""The I/O shell: the only code that opens files.

- `inputs`: the read side. Every file a command reads is checked (inside its tree, a regular file, not
  sparse, a size limit for whole reads) and opened here, and recorded as an input of the command;
  `OpenFiles` holds the checked fds of one input tree and range-checks every read against them;
- `pread`: the one positioned-read loop (`pread_into`, `pread_exact`);
- `safe_pickle`: allow-list unpickling after a bounds scan that builds nothing;
- `pickle_scan`: that bounds scan (`check_pickle_bounds`), an opcode replay on a model stack;
- `files`: new files only (`create_new`: O_CREAT|O_EXCL|O_NOFOLLOW), atomic single-file replacement;
- `lock`, `staging`: the output lock and the hidden temp dir renamed into place (`AtomicOutputDir`);
- `copy`: copies (and hard links) of input files into new outputs;
- `signals`: SIGTERM as an exception, signals held while a rename sequence runs.
"""
