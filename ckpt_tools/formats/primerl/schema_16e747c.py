"""prime-rl 16e747c (Jan 2026): every key of the combined `rl` config, with its default.

Transcribed from the config classes of commit 16e747c25e81c5c90bd860c68a588f7b151353a6 (pydantic 2.12.5,
pydantic-settings 2.10.1 per its uv.lock): `RLConfig` (src/prime_rl/rl.py:109-240, with its shared
`[ckpt]`, `[model]`, `[wandb]`, `[log]`, `[weight_broadcast]` tables), `RLTrainerConfig`
(trainer/rl/config.py:119-215 and trainer/config.py), `OrchestratorConfig` (orchestrator/config.py),
`InferenceConfig` (inference/config.py), `utils/config.py` (client, log, wandb, heartbeat) and
`transport/config.py`. DROP tables are the plain-`BaseModel` ones (unknown keys vanish); everything
else forbids unknown keys. `toml_files` is a key of every `BaseSettings` table (the root, trainer,
orchestrator, inference and the shared tables). The orchestrator's run-dir copy
(`outputs/run_*/configs/orch.toml`) is the `orchestrator` table of this tree.
"""
from __future__ import annotations

from .schema import DROP, FORBID, FREE, OPTIONAL, REQUIRED, SUB, TABLE_LIST, Schema, T, V

__all__ = ["SCHEMA"]


def _inference_tables(root: str) -> tuple:
    """`InferenceConfig` (inference/config.py:122): `[inference]`, and `[teacher_inference]` likewise."""
    return (
        T(root, FORBID, {
            'toml_files': None, 'server': SUB, 'model': SUB, 'parallel': SUB, 'enable_lora': False, 'max_loras': 8,
            'max_cpu_loras': 100, 'max_lora_rank': None, 'gpu_memory_utilization': 0.9, 'api_server_count': 1,
            'seed': 0, 'weight_broadcast': SUB,
        }),
        T(f'{root}.model', FORBID, {
            'name': 'Qwen/Qwen3-0.6B', 'dtype': 'auto', 'max_model_len': None, 'enforce_eager': False,
            'trust_remote_code': False, 'enable_auto_tool_choice': False, 'tool_call_parser': 'hermes',
            'reasoning_parser': None, 'rope_scaling': FREE(None),
        }),
        T(f'{root}.parallel', FORBID, {'tp': 1, 'dp': 1}),
        T(f'{root}.server', FORBID, {'host': None, 'port': 8000}),
        T(f'{root}.weight_broadcast', FORBID, {'toml_files': None, 'type': 'filesystem'}),
    )


_TABLES = (
    T('', FORBID, {
        'toml_files': None, 'trainer': SUB, 'orchestrator': SUB, 'inference': OPTIONAL, 'log': SUB, 'clean': True,
        'inference_gpu_ids': [0], 'trainer_gpu_ids': [1], 'teacher_gpu_ids': None, 'teacher_inference': OPTIONAL,
        'output_dir': 'outputs', 'ckpt': OPTIONAL, 'wandb': OPTIONAL, 'model': OPTIONAL, 'max_steps': None,
        'max_model_len': None, 'seq_len': None, 'max_async_level': None, 'bench': False,
        'weight_broadcast': OPTIONAL,
    }),
    T('ckpt', FORBID, {
        'toml_files': None, 'interval': None, 'resume_step': None, 'keep_last': None, 'keep_interval': None,
    }),
    *_inference_tables('inference'),
    *_inference_tables('teacher_inference'),
    T('log', FORBID, {'toml_files': None, 'level': 'info', 'file': True}),
    T('model', FORBID, {'toml_files': None, 'name': 'Qwen/Qwen3-0.6B'}),
    T('orchestrator', FORBID, {
        'toml_files': None, 'client': SUB, 'model': SUB, 'optim': SUB, 'teacher_model': OPTIONAL, 'sampling': SUB,
        'env': TABLE_LIST, 'eval': OPTIONAL, 'buffer': SUB, 'advantage': SUB, 'log': SUB, 'wandb': OPTIONAL,
        'prime_monitor': OPTIONAL, 'ckpt': OPTIONAL, 'val': OPTIONAL, 'weight_broadcast': SUB,
        'rollout_transport': SUB, 'trajectory_strategy': 'interleaved', 'output_dir': 'outputs/run_default',
        'max_concurrent': None, 'workers_per_env': 1, 'batch_size': 128, 'oversampling_factor': 1.0,
        'rollouts_per_example': 1, 'seq_len': 2048, 'mask_env_responses': True, 'num_train_workers': 1,
        'max_steps': None, 'max_off_policy_steps': 8, 'max_async_level': 1, 'strict_async_level': False,
        'bench': False, 'seed': 42, 'heartbeat': OPTIONAL,
    }),
    T('orchestrator.advantage', FORBID, {'length_weighted_mean': False}),
    T('orchestrator.buffer', FORBID, {
        'seed': None, 'env_ratios': None, 'easy_threshold': None, 'hard_threshold': None, 'easy_fraction': 0.0,
        'hard_fraction': 0.0, 'online_difficulty_filtering': False, 'hash_keys': ['task', 'prompt'],
        'skip_verification': False,
    }),
    T('orchestrator.ckpt', FORBID, {
        'interval': None, 'resume_step': None, 'keep_last': None, 'keep_interval': None, 'skip_progress': False,
        'skip_buffer': False,
    }),
    T('orchestrator.client', FORBID, {
        'timeout': 1200, 'base_url': ['http://localhost:8000/v1'], 'api_key_var': 'OPENAI_API_KEY',
        'headers': FREE({}),
    }),
    T('orchestrator.env', FORBID, {'id': 'reverse-text', 'args': FREE({}), 'name': None}),
    T('orchestrator.eval', FORBID, {
        'env': TABLE_LIST, 'sampling': SUB, 'save': SUB, 'retry': SUB, 'num_examples': -1,
        'rollouts_per_example': 1, 'reasoning_field': 'reasoning_content', 'per_rollout': False, 'interval': 100,
        'eval_base_model': True, 'skip_eval_on_resume': True,
    }),
    T('orchestrator.eval.env', FORBID, {
        'id': 'reverse-text', 'args': FREE({}), 'name': None, 'num_examples': None, 'rollouts_per_example': None,
        'skip_first': 0,
    }),
    T('orchestrator.eval.retry', FORBID, {
        'max_attempts': 10, 'wait_multiplier': 1.0, 'wait_min': 1.0, 'wait_max': 60.0, 'reraise': True,
    }),
    T('orchestrator.eval.sampling', FORBID, {
        'temperature': None, 'repetition_penalty': None, 'top_p': None, 'top_k': None, 'min_p': None,
        'max_tokens': None, 'min_tokens': None, 'reasoning_effort': None, 'seed': None, 'extra_body': FREE({}),
    }),
    T('orchestrator.eval.save', FORBID, {'disk': OPTIONAL, 'hf': OPTIONAL, 'env_hub': False, 'stream': False}),
    T('orchestrator.eval.save.disk', FORBID, {'path': None}),
    T('orchestrator.eval.save.hf', FORBID, {
        'dataset_name': None, 'dataset_subset': None, 'dataset_split': None, 'private': False,
    }),
    T('orchestrator.heartbeat', FORBID, {'url': REQUIRED}),
    T('orchestrator.log', FORBID, {'level': 'info', 'vf_level': 'warn', 'file': True, 'log_data': False}),
    T('orchestrator.model', FORBID, {'name': 'Qwen/Qwen3-0.6B', 'trust_remote_code': False, 'lora': OPTIONAL}),
    T('orchestrator.model.lora', FORBID, {'name': None, 'rank': None, 'alpha': 16.0}),
    T('orchestrator.optim', FORBID, {'lr': 0.0001}),
    T('orchestrator.prime_monitor', FORBID, {
        'base_url': 'https://api.primeintellect.ai/api/internal/rft', 'api_key_var': 'PRIME_API_KEY',
        'log_extras': SUB,
    }),
    T('orchestrator.prime_monitor.log_extras', FORBID, {'samples': True, 'distributions': True, 'interval': 10}),
    V('orchestrator.rollout_transport', DROP, default='filesystem', variants={
        'filesystem': {'type': 'filesystem'},
        'zmq': {'type': 'zmq', 'host': 'localhost', 'port': 5555, 'hwm': 10}}),
    T('orchestrator.sampling', FORBID, {
        'temperature': 1.0, 'repetition_penalty': 1.0, 'max_tokens': None, 'min_tokens': 0, 'seed': None,
        'extra_body': FREE({}),
    }),
    T('orchestrator.teacher_model', FORBID, {'client': SUB, 'model': SUB}),
    T('orchestrator.teacher_model.client', FORBID, {
        'timeout': 1200, 'base_url': ['http://localhost:8000/v1'], 'api_key_var': 'OPENAI_API_KEY',
        'headers': FREE({}),
    }),
    T('orchestrator.teacher_model.model', FORBID, {
        'name': 'Qwen/Qwen3-0.6B', 'trust_remote_code': False, 'lora': OPTIONAL,
    }),
    T('orchestrator.teacher_model.model.lora', FORBID, {'name': None, 'rank': None, 'alpha': 16.0}),
    T('orchestrator.val', FORBID, {'num_examples': 16, 'rollouts_per_example': 1, 'interval': 10}),
    T('orchestrator.wandb', FORBID, {
        'project': 'prime-rl', 'name': None, 'offline': False, 'id': None, 'log_extras': SUB,
    }),
    T('orchestrator.wandb.log_extras', FORBID, {'samples': True, 'distributions': True, 'interval': 10}),
    V('orchestrator.weight_broadcast', DROP, default='filesystem', variants={
        'filesystem': {'type': 'filesystem'},
        'nccl': {'type': 'nccl', 'host': 'localhost', 'port': 29501, 'timeout': 1200}}),
    T('trainer', FORBID, {
        'toml_files': None, 'model': SUB, 'tokenizer': SUB, 'data': SUB, 'loss': SUB, 'optim': SUB,
        'scheduler': SUB, 'ckpt': OPTIONAL, 'weight_broadcast': SUB, 'rollout_transport': SUB, 'log': SUB,
        'wandb': OPTIONAL, 'output_dir': 'outputs', 'max_steps': None, 'max_async_level': 1,
        'memory_profiler_path': None, 'bench': False, 'trace_path': None, 'dist_timeout_seconds': 600,
        'heartbeat': OPTIONAL, 'max_concurrent_runs': 1,
    }),
    T('trainer.ckpt', FORBID, {
        'interval': None, 'weights': SUB, 'resume_step': None, 'keep_last': None, 'keep_interval': None,
        'skip_progress': False, 'skip_scheduler': False, 'skip_dataloader': False,
    }),
    T('trainer.ckpt.weights', FORBID, {
        'save_sharded': True, 'save_format': 'safetensors', 'save_adapter_separately': False,
    }),
    T('trainer.data', FORBID, {'fake': OPTIONAL}),
    T('trainer.data.fake', FORBID, {'batch_size': 2, 'generate_samples': False}),
    T('trainer.heartbeat', FORBID, {'url': REQUIRED}),
    T('trainer.log', FORBID, {'level': 'info', 'vf_level': 'warn', 'file': True, 'log_data': False}),
    T('trainer.loss', FORBID, {
        'ratio_type': 'token', 'token_mask_high': 8.0, 'token_mask_low': 0.125, 'sequence_clip_high': 10.0,
        'geo_mask_high': 10.0, 'geo_mask_low': 0.1, 'sequence_mask_low': 0.0, 'sequence_mask_high': 100.0,
        'adv_tau': 1.0, 'teacher_tau': 0.0, 'kl_tau': 0.0,
    }),
    T('trainer.model', FORBID, {
        'name': 'Qwen/Qwen3-0.6B', 'seq_len': 2048, 'attn': 'flash_attention_2', 'compile': OPTIONAL,
        'ac': OPTIONAL, 'ac_offloading': OPTIONAL, 'fsdp_cpu_offload': False, 'reshard_after_forward': True,
        'trust_remote_code': False, 'dp_replicate': 1, 'ep': 1, 'tp': 1, 'cp': 1, 'impl': 'auto',
        'optimization_dtype': 'float32', 'reduce_dtype': 'float32', 'moe_use_grouped_mm': True, 'lora': OPTIONAL,
        'debug': SUB, 'fused_lm_head_chunk_size': None,
    }),
    T('trainer.model.ac', FORBID, {'freq': 1}),
    T('trainer.model.ac_offloading', FORBID, {'pin_memory': True, 'max_inflight_activations': 5}),
    T('trainer.model.compile', FORBID, {'fullgraph': False}),
    T('trainer.model.debug', FORBID, {'num_layers': None, 'random_init': False}),
    T('trainer.model.lora', FORBID, {
        'rank': 16, 'alpha': 16.0, 'dropout': 0.0,
        'target_modules': ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj', 'experts'],
        'modules_to_save': [],
    }),
    V('trainer.optim', DROP, default='adamw', variants={
        'sgd': {'lr': 1e-06, 'weight_decay': 0.01, 'max_norm': 1.0, 'type': 'sgd', 'nesterov': True, 'momentum': 0.9},
        'adamw': {'lr': 1e-06, 'weight_decay': 0.01, 'max_norm': 1.0, 'type': 'adamw', 'betas1': 0.9, 'betas2': 0.999},
        'muon': {'lr': 1e-06, 'weight_decay': 0.01, 'max_norm': 1.0, 'type': 'muon', 'betas1': 0.9, 'betas2': 0.999}}),
    V('trainer.rollout_transport', DROP, default='filesystem', variants={
        'filesystem': {'type': 'filesystem'},
        'zmq': {'type': 'zmq', 'host': 'localhost', 'port': 5555, 'hwm': 10}}),
    V('trainer.scheduler', DROP, default='constant', variants={
        'constant': {'type': 'constant'},
        'linear': {'type': 'linear', 'warmup_steps': 10, 'decay_steps': 10, 'min_lr': 0.0},
        'cosine': {'type': 'cosine', 'warmup_steps': 10, 'min_lr': 0.0}}),
    T('trainer.tokenizer', FORBID, {'name': None, 'trust_remote_code': None, 'chat_template': None}),
    T('trainer.wandb', FORBID, {'project': 'prime-rl', 'name': None, 'offline': False, 'id': None}),
    V('trainer.weight_broadcast', DROP, default='filesystem', variants={
        'filesystem': {'type': 'filesystem', 'save_sharded': True, 'save_format': 'safetensors'},
        'nccl': {'type': 'nccl', 'host': 'localhost', 'port': 29501, 'timeout': 1200, 'inference_world_size': 1}}),
    T('wandb', FORBID, {'toml_files': None, 'project': 'prime-rl', 'name': None, 'offline': False}),
    T('weight_broadcast', FORBID, {'toml_files': None, 'type': 'filesystem'}),
)

SCHEMA = Schema.of("16e747c", "16e747c25e81c5c90bd860c68a588f7b151353a6",
                   "prime-rl 16e747c config classes (rl.py, trainer/config.py, trainer/rl/config.py, "
                   "orchestrator/config.py, inference/config.py, utils/config.py, transport/config.py)", _TABLES)
