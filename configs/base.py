"""Defaults shared by every training config; each config file starts from `get_base()`."""

import ml_collections


def get_base() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.multihost = False  # True: jax.distributed.initialize() (one process per host)
    # Where the processes meet; empty / 0 / -1: detected from the cluster (TPU pod, Slurm, Open MPI).
    c.distributed = ml_collections.ConfigDict()
    c.distributed.coordinator_address = ""  # host:port of process 0
    c.distributed.num_processes = 0
    c.distributed.process_id = -1
    c.mesh = (1, -1, 1)  # (data, fsdp, tensor); -1 takes the remaining devices
    c.export_hf = True  # write workdir/hf (an HF directory with the mask token) at the end
    # Start from another run's checkpoint (state and data position) when this workdir has none:
    # its workdir, and the step (0 = its latest). E.g. branch a decay phase off a long WSD run.
    c.init_from = ""
    c.init_step = 0

    c.model = ml_collections.ConfigDict()
    c.model.name = ""  # a model to fine-tune: known name, HF directory or .gguf file
    c.model.architecture = ml_collections.config_dict.placeholder(dict)  # or random init of this ModelConfig
    c.model.tokenizer = ""  # with `architecture`: where the tokenizer comes from (name / dir / gguf)
    c.model.dtype = "float32"  # compute dtype; master weights and optimizer state stay float32
    c.model.scan_layers = False
    c.model.remat = "none"  # none | full | dots
    c.model.attention = "auto"  # auto | reference | blockwise | splash (TPU; see sbd_jax/model/attention.py)

    c.data = ml_collections.ConfigDict()
    c.data.files = ()  # JSONL (text / messages) or text files, globs allowed; a tuple, for --config overrides
    c.data.seq_len = 256
    # Streamed (sbd_jax/data/streaming.py): the global batch is every shard's next rows; shard s is read by host
    # s % hosts. 0 = one shard per host. Batches depend on (files, seed, shards, workers), not on hosts.
    c.data.shards = 0
    c.data.workers = 2  # Grain worker processes per shard that read, tokenize and pack (0: in the main process)
    c.data.mask_token = "new"  # 'new' (a new embedding row), an existing token's text, or its id ("198")

    c.objective = ml_collections.ConfigDict()
    c.objective.kind = "sbd"  # sbd | ntp (baseline)
    c.objective.block_size_min = 2
    c.objective.block_size_max = 16
    c.objective.w_ntp = 1.0
    c.objective.w_matp = 1.0
    c.objective.eta_min = 0.0
    c.objective.eta_max = 1.0
    # What the drafts train on (sbd_jax/training/objective.py DraftTraining; 0 = the paper's objective): the share of
    # rows masked entirely, the MATP weight's decay scale over block positions, the weight of soft targets.
    c.objective.full_mask_share = 0.0
    c.objective.position_decay = 0.0
    c.objective.soft_target = 0.0

    c.train = ml_collections.ConfigDict()
    c.train.steps = 100
    c.train.batch_size = 8
    c.train.grad_accum = 1
    c.train.log_every = 10  # steps between metric fetches (the only host sync; checkpoints fetch too)

    c.optimizer = ml_collections.ConfigDict()
    c.optimizer.lr = 3e-4
    c.optimizer.warmup_steps = 10
    c.optimizer.schedule = "cosine"  # cosine (to final_lr_ratio at train.steps) | wsd (warmup-stable-decay)
    c.optimizer.decay_steps = 0  # wsd: linear decay to final_lr_ratio over the last decay_steps steps
    c.optimizer.final_lr_ratio = 0.1
    c.optimizer.b1 = 0.9
    c.optimizer.b2 = 0.95
    c.optimizer.eps = 1e-8
    c.optimizer.weight_decay = 0.1
    c.optimizer.clip_norm = 1.0

    # The gated adapter (sbd_jax/checkpoints/adapter.py): rank 0 fine-tunes every weight (the paper); rank > 0 freezes the
    # base and trains a low-rank adapter on block positions only, so NTP stays the base model's exactly.
    c.adapter = ml_collections.ConfigDict()
    c.adapter.rank = 0
    c.adapter.alpha = 32.0
    c.adapter.targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 50
    c.checkpoint.keep = 3
    c.checkpoint.keep_period = 0  # > 0: also keep every checkpoint whose step is a multiple of it (milestones)
    c.checkpoint.async_save = True
    return c


def paper_recipe_8b(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The paper's 8B SFT recipe: AdamW lr 3e-4, warmup 200, cosine, 34k steps, ~2M tokens a batch
    (512 x 4096), bf16 compute, full remat, scanned layers, fsdp over all devices."""
    c.model.dtype = "bfloat16"
    c.model.scan_layers = True
    c.model.remat = "full"
    c.mesh = (1, -1, 1)
    c.data.seq_len = 4096
    c.train.steps = 34000
    c.train.batch_size = 512
    c.train.grad_accum = 64
    c.optimizer.lr = 3e-4
    c.optimizer.warmup_steps = 200
    c.checkpoint.every = 500
    return c
