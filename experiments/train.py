"""Train a small MoE language model with any router; one process, or torchrun on any DeviceMesh
layout (FSDP2 x expert parallel, ``moe.parallel.mesh``).

    python experiments/train.py --preset tiny --router topk --steps 300
    python experiments/train.py --router capacity --router-option top_k=2 --router-option capacity_factor=1.0 \
        --steps 300 --eval-every 100 --metrics-jsonl runs/cap/metrics.jsonl --checkpoint-dir runs/cap --checkpoint-every 100
    python experiments/train.py --router capacity --router-option top_k=2 --router-option capacity_factor=1.0 \
        --steps 300 --eval-every 100 --metrics-jsonl runs/cap/metrics.jsonl --checkpoint-dir runs/cap --checkpoint-every 100 \
        --resume      # after an interruption: the same command continues the very run
    python experiments/train.py --data canary --seq-len 8 --batch-size 64 --router expert_choice --steps 2000
    python experiments/train.py --data path/to/my/texts --router topk
    python experiments/train.py --hf-model olmoe-tiny --router ec_threshold --steps 300   # needs the [hf] extra
    python experiments/train.py --hf-model path/to/local/olmoe --router capacity --router-option capacity_scope=prefix
    torchrun --nproc_per_node 2 experiments/train.py --preset tiny --router topk --batch-size 16
    torchrun --standalone --nproc-per-node 2 experiments/train.py --preset tiny --expert-parallel 2 --steps 12 \
        --metrics-jsonl runs/ep2/metrics.jsonl
    torchrun --standalone --nproc-per-node 4 experiments/train.py --preset tiny --router topk --steps 12 \
        --batch-size 8 --seq-len 64 --expert-parallel 2 --metrics-jsonl runs/ep2x2/metrics.jsonl
    torchrun --standalone --nproc-per-node 4 experiments/train.py --preset tiny --dp-replicate 2 --expert-parallel 2
    torchrun --standalone --nproc-per-node 4 --max-restarts 3 experiments/train.py --preset small \
        --checkpoint-dir runs/small --checkpoint-every 50 --resume      # a crashed rank restarts the job
    torchrun --standalone --nproc-per-node 2 experiments/train.py --preset tiny --grad-reduce-dtype bf16   # logs its error
    torchrun --standalone --nproc-per-node 4 experiments/train.py --preset tiny --packet-loss 0.1 \
        --loss-policy unbiased --metrics-jsonl runs/loss10/metrics.jsonl      # simulated lossy data parallel

    python experiments/train.py --config run.toml --steps 600      # a TOML file, flags override it

Every field of every section of ``moe.training.TrainConfig`` is a flag named after the field
(``--help`` lists them, tyro generates them), and every field of ``moe.model.ModelConfig``
overrides the preset (``--d-model 128 --num-experts 8``). ``--config FILE`` reads the same
fields from TOML sections (``[optimizer]`` ``steps = 600``; ``moe.training.config`` lists them)
or from the ``<metrics>.config.json`` that every run with ``--metrics-jsonl`` writes beside its
metrics: its full resolved configuration.
``--hf-model`` trains a Hugging Face transformers MoE model instead (a local directory or a
built-in tiny random config, ``moe.integrations.hf.TINY_CONFIGS``; never a download), its MoE
blocks routed by ``--router`` (``topk`` without options keeps the family's own routing).
wandb logs on rank 0 (the [wandb] extra, opt-in): --wandb-mode or $WANDB_MODE; unasked, none for a run with no
folder of its own or without wandb installed, else offline unless $WANDB_API_KEY is set.
"""

from moe.extras import MissingExtra

try:
    from moe.training.cli import script
except MissingExtra as e:  # a core install without the [train] extra: one line, not a traceback
    raise SystemExit(f"error: {e}") from None

if __name__ == "__main__":
    script()
