"""Named tensors, read one at a time by range, whatever holds them: the `Source` protocol (`base`) over
an HF dir or hub id (`hf`), a DCP checkpoint's base weights (`dcp`), a single weights file (`files`),
and LoRA factors from a PEFT dir or a DCP checkpoint (`lora`); `open` picks the kind of a path;
`compare` and `hashing` stream over sources (bitwise identity, the slim manifest's hashes)."""
