"""File formats: safetensors files and Hugging Face model directories (read and write bytes, no math)."""
