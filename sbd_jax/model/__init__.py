"""The model: its config (`config`), the transformer (`transformer`) and its optional gated adapter (`adapter`),
attention and its masks (`attention`, `splash`, `masks`), rotary positions (`rope`), the KV cache
(`kv_cache`), the weights' axes and shapes (`params`), how parameters are sharded (`sharding`) and the
mask token (`mask_token`).
Imports only `sbd_jax.errors` and `sbd_jax.choice`: every other room builds on this one."""
