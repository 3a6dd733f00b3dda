"""Click commands, one module per command: each parses its arguments, calls one op (or workflow) and renders."""
