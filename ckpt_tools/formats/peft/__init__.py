"""PEFT LoRA adapter dirs, read (`adapter`, `config`) and written (`writer`)."""
