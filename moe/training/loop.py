"""The training loop used by the experiments: AdamW, warmup + cosine decay, gradient clipping,
bf16 autocast on CUDA (fp32 on CPU), periodic teacher-forced and causal evaluation, atomic
checkpoints with exact resume, a metrics JSONL, and wandb on rank 0.

Launched by ``experiments/train.py`` (single process or ``torchrun`` data parallel):

    python experiments/train.py --preset tiny --router topk --steps 300
    torchrun --nproc_per_node 2 experiments/train.py --preset tiny --router topk --batch-size 16
    torchrun --standalone --nproc-per-node 2 experiments/train.py --preset tiny --expert-parallel 2

Data parallel: ``--batch-size`` is global. Every rank draws the same global batch of step s
from (seed, s) and keeps its own contiguous slice, so the union over ranks is the
single-process batch; gradients (and the router statistics that ``update_after_step`` folds
in) are averaged over ranks before they are used. Logging, wandb and checkpoints happen on
rank 0 only; every rank evaluates (the same windows), so a sharded model can join in.

On more than one process the model lives on a DeviceMesh (``moe.parallel.mesh``) built from
``--pipeline-parallel Q --dp-replicate R --expert-parallel P``: the blocks cut into Q pipeline
stages (``moe.parallel.pipeline``; a rank then holds one stage and its data-parallel share of
the batch flows through the stages in ``--microbatches M`` microbatches), and within a stage
dense weights FSDP2-sharded over the stage's data-parallel ranks (HSDP when R > 1), experts
split over P expert-parallel ranks and FSDP2-sharded over what remains, gradients reduced by
FSDP2. No rank ever holds the whole model: it is built on the meta device (parameters without
storage; under expert parallelism each MoE layer already holds only this rank's experts), cut
to this rank's pipeline stage, compiled and recomputed per block as asked (``--compile``,
``--activation-checkpointing``), sharded by FSDP2, and only then materialised shard by shard (``moe.training.placement``, ``moe.parallel.materialize``):
each parameter is generated whole at its single-process shape by the model's own initialiser
for its name, one at a time, and each rank keeps its piece (a transformers model, whose
initialisation is not a function of the name, is built once on rank 0 and broadcast the same
way). So initialisation, batches and (with the routers counting load-balancing fractions over
all data-parallel ranks) every step's loss match the single-process run to fp32 rounding.
Clipping uses the whole model's norm. ``--microbatches M`` alone accumulates the gradients of
M microbatches. On CPU the run first fixes glibc's mmap threshold (``--cpu-mmap-threshold-kib``,
``moe.parallel.memory.limit_cpu_malloc``), so the peak_memory_mib it logs follows the tensors,
or keeps freed memory for speed (``--cpu-malloc-keep``).

The loop itself is short: :func:`prepare` places the model once (``moe.training.placement``,
which picks the step strategy: plain, pipelined, lossy data parallel, ...), :func:`train_step`
asks the strategy for the gradients and their update, and the rest is evaluation, reports and
checkpoints.

Shape legend: B batch (local to a rank unless named global), T sequence, V vocabulary,
E experts, L MoE layers, W evaluation windows, P evaluated positions per window.
"""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from moe.data import Corpus
from moe.eval import evaluate
from moe.layer import update_routers
from moe.model import ModelConfig
from moe.parallel import share_router_statistics
from moe.parallel.exchange import EAGER_UNDER_COMPILE
from moe.parallel.memory import largest_peak_mib, limit_cpu_malloc
from moe.parallel.placement import Placement
from moe.routers.quantile_global import register_quantile_balancing_hook
from moe.routing import Router
from moe.training.batches import check_eval_windows, local_batch
from moe.training.build import build_run_model, hf_recipe, model_config, total_parameters
from moe.training.checkpoint_files import (
    EXPORT_NAME,
    HF_EXPORT_NAME,
    complete_checkpoints,
    export_model,
    load_export,
    rotate_checkpoints,
    save_checkpoint,
)
from moe.training.config import TrainConfig
from moe.training.distributed import DistInfo, inject_fault, setup_distributed, sync_router_state
from moe.training.guards import (
    FINAL_CHECKED,
    WORSE_THAN_UNIFORM,
    Diverged,
    RunStopped,
    check_outputs,
    check_room,
    non_finite,
    on_rank0_for_all,
    weights_finite,
    worse_than_uniform,
)
from moe.training.metrics import RouterEntropy, StepTally
from moe.training.optim import lr_at, make_optimizer, set_lr
from moe.training.placement import place_model
from moe.training.report import RunReport
from moe.training.resume import refuse_foreign, refuse_foreign_metrics, resume
from moe.training.steps import StepStrategy


@dataclass
class TrainResult:
    """What :func:`train` returns (on every rank)."""

    model: nn.Module
    """The trained model: a MoETransformer (sharded on more than one process), or this rank's
    :class:`~moe.parallel.pipeline.StageModel` under pipeline parallelism."""
    optimizer: torch.optim.Optimizer
    model_config: ModelConfig
    history: list[dict]
    """The per-step metric records (rank 0; empty elsewhere), as written to the metrics JSONL."""
    final_eval: dict
    """Evaluation after the last step: teacher_forced_loss, causal_loss, leakage_gap, ..."""
    train_time_s: float
    """Wall time of the optimizer steps of this invocation (evaluation excluded)."""


@dataclass
class Session:
    """One run, placed and ready to step."""

    cfg: TrainConfig
    info: DistInfo
    corpus: Corpus
    mcfg: ModelConfig
    place: Placement
    strategy: StepStrategy
    """Makes and applies this rank's gradients (chosen when the model was placed)."""
    optimizer: torch.optim.Optimizer
    start: int
    """Steps already taken (a resumed run's checkpoint step, else 0)."""
    report: RunReport
    entropy: RouterEntropy
    num_experts: int
    steps_done: int = 0
    """Steps finished and reported so far: where an interruption left the run."""
    unproven: Path | None = None
    """The checkpoint this invocation wrote last while no finite step has followed it yet: the
    older ones are rotated away only once one has (:func:`settle`)."""
    warned: bool = False
    """Whether the run said that its loss is worse than a uniform guess (once: :func:`settle`)."""


class SetupError(ValueError):
    """The run cannot start as configured (a user error: ``experiments/train.py`` prints it in
    one line and exits 2)."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) stopped a run after it started stepping, and where: still a
    KeyboardInterrupt to a caller of :func:`train`; ``experiments/train.py`` says it in one line
    (:func:`moe.training.cli.main`)."""

    def __init__(self, steps_done: int, steps: int, checkpoint_dir: Path | None, checkpoint: Path | None) -> None:
        super().__init__(f"interrupted after step {steps_done} of {steps}")
        self.steps_done, self.steps = steps_done, steps
        self.checkpoint_dir = checkpoint_dir
        """The run's --checkpoint-dir (None: it writes none)."""
        self.checkpoint = checkpoint
        """The last complete checkpoint there, which --resume loads (None: none yet)."""


def train(cfg: TrainConfig, corpus: Corpus | None = None) -> TrainResult:
    """Train one model as ``cfg`` says (see the module docstring for the distributed contract).
    A ValueError before the first step (data, model, layout, checkpoint) is a :class:`SetupError`."""
    info = setup_distributed(cfg.parallel.device, cfg.parallel.collective_timeout_s)
    try:
        try:
            session = prepare(cfg, corpus, info)
        except ValueError as e:
            raise SetupError(str(e)) from e
        try:
            return run(session)
        except KeyboardInterrupt:
            session.report.interrupted()
            directory = cfg.checkpoint.directory
            found = complete_checkpoints(directory) if directory is not None else []
            raise Interrupted(
                session.steps_done, cfg.optimizer.steps, directory, found[-1] if found else None
            ) from None
    finally:
        if info.owns_group:
            dist.destroy_process_group()


def prepare(cfg: TrainConfig, corpus: Corpus | None, info: DistInfo) -> Session:
    """Load the data, build and place the model with its step strategy, make the optimizer,
    resume from the last checkpoint if asked, and open the run's reports."""
    if not cfg.checkpoint.resume:  # before anything is written
        refuse_foreign(cfg.checkpoint.directory)
        refuse_foreign_metrics(cfg.logging.metrics_jsonl)
    on_rank0_for_all(lambda: check_outputs(cfg.checkpoint.directory, cfg.logging.metrics_jsonl))
    malloc_note = limit_cpu_malloc(  # before the big allocations
        info.device, cfg.parallel.cpu_mmap_threshold_kib, cfg.parallel.cpu_malloc_keep
    )
    corpus = corpus if corpus is not None else cfg.data.load()
    mcfg = model_config(cfg.model, corpus.vocab_size)

    def build(expert_parallel) -> nn.Module:
        return build_run_model(cfg.model, mcfg, cfg.seed, info.device, info.world_size, expert_parallel)

    place, strategy = place_model(cfg, None if cfg.model.hf_model else mcfg.num_experts, build, info)
    check_eval_windows(corpus, cfg.data.seq_len, cfg.eval.eval_windows)  # a layout that does not fit is said first
    num_params = total_parameters(mcfg) if not cfg.model.hf_model else place.model.num_parameters()
    if cfg.checkpoint.directory is not None:  # fp32 weights and AdamW's two moments
        on_rank0_for_all(lambda: check_room(cfg.checkpoint.directory, 12 * num_params))
    optimizer = make_optimizer(place.model, cfg.optimizer)
    register_quantile_balancing_hook(optimizer, place.model)  # one all-reduce of every layer's histograms
    strategy.attach(optimizer)
    start, run_id, resumed, cfg = resume(cfg, place.model, optimizer, mcfg)
    report = RunReport(cfg, mcfg, info, start, run_id)
    report.banner(
        corpus,
        num_params,
        place.layout if info.world_size > 1 else None,
        place.model.architecture if cfg.model.hf_model else None,
    )
    for line in resumed:
        report.say(line)
    if malloc_note:
        report.say(malloc_note)
    if cfg.parallel.compile and cfg.parallel.expert_parallel > 1:
        report.say(f"--compile with --expert-parallel: {EAGER_UNDER_COMPILE}")
    routers = [m for m in place.model.modules() if isinstance(m, Router)]
    return Session(
        cfg,
        info,
        corpus,
        mcfg,
        place,
        strategy,
        optimizer,
        start,
        report,
        RouterEntropy(place.model, info.device),
        routers[0].num_experts if routers else mcfg.num_experts,
    )


def train_step(s: Session, step: int) -> tuple[dict, float]:
    """One optimizer step (1-based ``step``) through the run's strategy: (its record, seconds)."""
    cfg, info, place = s.cfg, s.info, s.place
    inject_fault(step, info)
    t0 = time.perf_counter()
    lr = lr_at(step - 1, cfg.optimizer)
    set_lr(s.optimizer, lr)
    try:
        idx_BT, targets_BT = local_batch(
            s.corpus, cfg.data, cfg.seed, step, info.device, (place.dp_rank, place.dp_size)
        )
    except ValueError as e:  # the corpus holds ids outside its vocabulary
        raise RunStopped(f"step {step}: {e}") from None
    s.entropy.pop()
    s.optimizer.zero_grad(set_to_none=True)
    tally = StepTally(place.num_moe_layers(), s.num_experts, info.device)
    s.strategy.gradients(idx_BT, targets_BT, tally)
    try:
        grad_norm, extra = s.strategy.update(step)
    except RuntimeError as e:  # AdamW's step size beyond float32 ("cannot be converted ... without overflow")
        if "overflow" not in str(e):
            raise
        stop_if_diverged(s, step, [f"the optimizer step overflows ({e})"])
    sync_router_state(place.model, info, place.dp_group)
    update_routers(place.model)
    record = {"step": step, **tally.finish(s.entropy.pop(), place.layout.pipeline)}
    if info.device.type == "cuda":
        torch.cuda.synchronize(info.device)
    dt = time.perf_counter() - t0
    tokens_per_s = cfg.data.batch_size * cfg.data.seq_len / dt
    record.update(lr=lr, grad_norm=grad_norm, tokens_per_s=tokens_per_s, peak_memory_mib=largest_peak_mib(info.device))
    record.update(extra)
    return record, dt


def stop_if_diverged(s: Session, step: int, bad: list[str]) -> None:
    """Stop the run (:class:`~moe.training.guards.Diverged`) if ``bad`` names a non-finite figure
    of ``step``, first removing the checkpoint this invocation wrote last if no finite forward
    has followed it (its older ones were kept for this: :func:`settle`)."""
    if not bad:
        return
    directory = s.cfg.checkpoint.directory
    if s.unproven is not None and s.info.is_main:
        shutil.rmtree(s.unproven, ignore_errors=True)
    found = complete_checkpoints(directory) if directory is not None else []
    kept = f"the last checkpoint kept is {found[-1]}" if found else "no checkpoint of it is kept"
    raise Diverged(
        f"step {step}: {', '.join(bad)}: the run diverged and stopped ({kept}); lower --lr "
        f"(it was {lr_at(step - 1, s.cfg.optimizer):.2e} at this step) and --resume, or start over"
    )


def settle(s: Session, step: int, loss: float) -> None:
    """A finite forward followed the last checkpoint: rotate the older ones away, unless the
    loss is worse than a uniform guess (``moe.training.guards.worse_than_uniform``, said once)."""
    vocab = s.mcfg.vocab_size
    diverging = worse_than_uniform(loss, vocab)
    if diverging and not s.warned:
        s.warned = True
        s.report.warn(
            f"step {step}: the training loss {loss:.4g} is more than {WORSE_THAN_UNIFORM:g}x a uniform "
            f"guess's (ln {vocab} = {math.log(vocab):.3f}): diverging (--lr)? While it lasts no older checkpoint "
            "is rotated away"
        )
    if s.unproven is not None and not diverging:
        rotate_checkpoints(s.cfg.checkpoint.directory, s.cfg.checkpoint.keep_checkpoints, s.info)
        s.unproven = None


def checkpoint(s: Session, step: int) -> None:
    """Write the checkpoint of ``step``, unless the weights are not finite (then the run stops,
    :class:`~moe.training.guards.Diverged`: nothing is written, nothing rotated away)."""
    if not weights_finite(s.place.model):
        stop_if_diverged(s, step, ["the weights are not finite after the update"])
    s.unproven = save_checkpoint(
        s.cfg.checkpoint.directory, s.place.model, s.optimizer, step, s.cfg, s.mcfg, s.info, s.report.run_id
    )


def run_eval(s: Session, step: int) -> tuple[dict, float]:
    """The evaluation after ``step`` (a progress bar on rank 0 when the run shows one) and its
    wall time in seconds."""
    e, t0 = s.cfg.eval, time.perf_counter()
    shown = s.info.is_main and s.cfg.logging.progress
    ev = evaluate(
        s.place.eval_model,
        s.corpus.val,
        s.cfg.data.seq_len,
        e.eval_windows,
        e.causal_stride,
        e.eval_batch_size,
        s.info.device,
        causal_batch_size=e.causal_batch_size,
        progress=f"eval step {step}" if shown else None,
    )
    return ev, time.perf_counter() - t0


def run(s: Session) -> TrainResult:
    """The steps after ``s.start``, with evaluations, reports and checkpoints; then the final
    evaluation and export. A non-finite step stops the run (:func:`check_step`)."""
    cfg, place, last = s.cfg, s.place, s.cfg.optimizer.steps
    final_eval: dict = {}
    train_time = 0.0
    place.model.train()
    s.steps_done = s.start
    for step in range(s.start + 1, last + 1):
        record, dt = train_step(s, step)
        train_time += dt
        stop_if_diverged(s, step, non_finite(record))
        settle(s, step, record["loss"])
        if step == last or (cfg.eval.eval_every and step % cfg.eval.eval_every == 0):
            ev, seconds = run_eval(s, step)
            record.update({f"eval/{k}": v for k, v in ev.items()}, **{"eval/time_s": seconds})
            final_eval = ev if step == last else final_eval
        s.report.step(record)
        s.steps_done = step
        if cfg.checkpoint.due(step, last):
            checkpoint(s, step)
    if cfg.checkpoint.export_model or cfg.checkpoint.export_hf:
        hf = hf_recipe(cfg.model, place.model, s.mcfg.backend)
        export_model(cfg.checkpoint.directory / EXPORT_NAME, place.model, s.mcfg, s.info, place.pp_group, hf)
    if cfg.checkpoint.export_hf and s.info.is_main:
        from moe.integrations.hf import export_pretrained  # the [hf] extra, imported only when asked for

        folder = cfg.checkpoint.directory / HF_EXPORT_NAME
        written = export_pretrained(load_export(cfg.checkpoint.directory / EXPORT_NAME), folder)
        s.report.say(f"Hugging Face checkpoint: {folder} ({written})")
    s.entropy.close()
    final_eval = final_eval or run_eval(s, last)[0]
    stop_if_diverged(s, last, non_finite(final_eval, FINAL_CHECKED))
    settle(s, last, final_eval.get("teacher_forced_loss", 0.0))  # every rank evaluates
    s.report.close(final_eval)
    if place.dp_size > 1:
        share_router_statistics(place.model, None)  # the returned model's routers count locally again
        dist.barrier()  # no rank tears the group down while rank 0 still writes its checkpoint
    return TrainResult(place.model, s.optimizer, s.mcfg, s.report.history, final_eval, train_time)
