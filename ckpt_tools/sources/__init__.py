"""What is built over the formats' handles (each format's one handle implements the `Source` protocol of
`formats.handle`, or offers `Source` / `LoraSource` views): `open` picks the handle of a path (an HF dir or
hub id, a DCP checkpoint's base weights), `lora` a LoRA of a PEFT dir or a DCP checkpoint (and a full
fine-tune's none), `files` a single weights file, `delta` a LoRA computed in delta space; `compare` and
`hashing` stream over sources (bitwise identity, the slim manifest's hashes). `base` re-exports the
protocol."""
