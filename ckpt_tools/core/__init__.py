"""The pure core: facts and rules with no filesystem and no torch needed for names and sizes.

- `errors`: the typed errors every layer raises (`CkptError` and its kinds);
- `units`: byte sizes, printed (`human_bytes`) and parsed (`parse_size`);
- `dtypes`: dtype names, item sizes, safetensors codes and the `--dtype` spellings (the only `dtype_name`);
- `keys`: the prime-rl key rule table (what every DCP key is, from its planner path);
- `lora_math`: the LoRA scale (the only `lora_scale`), alpha and shape rules;
- `tensor_math`: the exact fp32 merge kernels, ulps and finiteness checks (these need torch);
- `tied`: tied-embedding pairs and how a config ties them;
- `primerl_state`: the non-tensor state of a prime-rl checkpoint (AppState facts);
- `accel`: whether the optional C fast paths may load (`CKPT_TOOLS_PURE_PYTHON`).
"""
