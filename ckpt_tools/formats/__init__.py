"""File formats, each owning its reads and writes: DCP checkpoints (`dcp`), safetensors (`safetensors`),
HF model dirs (`hf_dir`), PEFT adapters (`peft`), slim checkpoints (`slim`), prime-rl run configs
(`primerl`), and the one answer to "what is this path?" (`sniff`). Formats decode and encode; they do
no LoRA math and make no plans."""
