import _signal

from . import startup_signal_mask

# Ctrl-C and SIGTERM held from this first line, if the package did not already (entry.py: why, and when
# they are delivered)
_held = _signal.pthread_sigmask(_signal.SIG_BLOCK, {_signal.SIGINT, _signal.SIGTERM})

from . import entry  # noqa: E402

entry.HELD = startup_signal_mask if startup_signal_mask is not None else _held
entry.run()
