"""Click commands, one module per command: each parses its arguments, calls the api once and renders."""
