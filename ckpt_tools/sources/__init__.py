"""What the ops share, built over the formats' handles (an op never imports another op, so logic that two
ops use lives here, or lower when it is a format's or a pure fact): `open` opens a path of any format as
what ops read (`open_weights`: a `Source`; `open_lora_source`: a `LoraSource`), `compare` and `hashing`
stream over sources (bitwise identity, the slim manifest's hashes), `files` is a single weights file as a
`Source`, `delta` a LoRA computed in delta space (average, resize-adapter), `lr_plan` set-lr's plan (which
report draws)."""
