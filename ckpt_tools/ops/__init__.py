"""Library operations, one module per capability. The CLI is a thin layer over these."""
