"""The online-distillation training loop: live target features -> one block-masked draft forward -> FSDP2 step.

One code path for every scale: a single process is a world of one (gloo), `torchrun` gives N ranks (gloo on CPU,
nccl on GPU). The draft is wrapped in `ObjectiveModule` so the whole objective runs inside one FSDP forward (the
Markov and confidence heads are unsharded there like every other parameter); `fully_shard` is applied per draft
layer, then to the root. The frozen target embedding / lm_head stay outside the module tree: never sharded, never
trained, never saved.

Data order is a pure function of (seed, step): step s takes global-batch positions [s·G, (s+1)·G) of the seeded
epoch permutations, rank r the r-th slice, cut into micro-batches. Anchors are keyed by (seed, step, sample id).
Together with the DCP checkpoint of model + optimizer + scheduler + RNG this makes a resumed run take exactly the
batches, anchors and updates of an uninterrupted one, and makes N ranks equal 1 rank at the same global batch.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from dspark_sgl.model.draft import DSparkDraft
from dspark_sgl.progress import ProgressLine
from dspark_sgl.vocab import choose_vocab, coverage, load_vocab, save_vocab, stop_token_ids, token_counts
from training import checkpoint as ckpt
from training.data import Sample, epoch_order, prepare_samples
from training.objective import (
    STAT_NAMES,
    ObjectiveConfig,
    anchor_seed,
    compute_objective,
    normalise_gradients,
    sample_anchors,
    summarise,
)
from training.publish import Publisher
from training.recipe import Recipe, RecipeError
from training.sources import make_source
from training.target import (
    compute_dtype,
    draft_config,
    load_target_heads,
    resolve_target_path,
    target_config,
    target_dtype,
)
from training.warmstart import init_own_embedding, warm_start


class ObjectiveModule(nn.Module):
    """The draft plus its objective as one module, so FSDP's forward hooks cover the loss heads too."""

    def __init__(self, draft: DSparkDraft, cfg: ObjectiveConfig, scale_aux: bool = False):
        super().__init__()
        self.draft, self.cfg = draft, cfg
        # Why: target layers' outputs differ in scale by 10x between layers and up to 50x between channels (SmolLM2),
        # so fc's gradient is dominated by a few channels and Adam's uniform step size learns the rest slowly. fc is
        # trained on inputs divided by their per-channel RMS (measured on the first batch, 0 = not yet measured)
        # and exported with the scale folded into its weight: the checkpoint format does not change.
        self.register_buffer("aux_inv_scale", torch.zeros(draft.fc.in_features) if scale_aux else None)

    def forward(self, batch, anchors, valid):
        if self.aux_inv_scale is not None:
            batch = dataclasses.replace(batch, aux_hidden=batch.aux_hidden.float() * self.aux_inv_scale)
        return compute_objective(self.draft, batch, anchors, valid, self.cfg)

    def measure_aux_scale(self, batch) -> None:
        """Set aux_inv_scale from one micro-batch per rank (all ranks pooled), skipping each row's first token."""
        x = batch.aux_hidden.float()
        keep = torch.arange(x.shape[1], device=x.device)[None] < batch.lengths[:, None].to(x.device)
        keep[:, 0] = False  # the attention-sink token carries 1e4-scale activations
        stats = torch.cat([x[keep].pow(2).sum(0), keep.sum().reshape(1).float()]).double()
        dist.all_reduce(stats)
        rms = (stats[:-1] / stats[-1].clamp(min=1)).sqrt().float()
        self.aux_inv_scale.copy_(1.0 / rms.clamp(min=1e-3))


def fold_aux_scale(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Draft weights of an ObjectiveModule state dict, with a trained aux scale folded into fc.weight."""
    state = dict(state)
    inv = state.pop("aux_inv_scale", None)
    if inv is not None:
        key = "draft.context_proj.weight" if "draft.context_proj.weight" in state else "draft.fc.weight"  # MLA name
        state[key] = state[key] * inv.to(state[key].dtype)[None, :]
    return {k.removeprefix("draft."): v for k, v in state.items()}


@dataclass
class Dist:
    rank: int
    local_rank: int
    world: int
    device: torch.device


def init_distributed(device_spec: str = "auto") -> Dist:
    """torchrun's env when present, else a world of one; gloo on CPU, nccl on CUDA."""
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", rank))
    else:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        local = int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available() and device_spec in ("auto", "cuda")
    device = torch.device(f"cuda:{local}") if cuda else torch.device("cpu")
    if not dist.is_initialized():
        timeout = datetime.timedelta(hours=2)  # rank 0 may regenerate data while others wait
        if world == 1 and "MASTER_ADDR" not in os.environ:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
    if cuda:
        torch.cuda.set_device(device)
    return Dist(rank, local, world, device)


def shard(module: ObjectiveModule, compute_dtype: torch.dtype, reshard_after_forward: bool) -> ObjectiveModule:
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in module.draft.layers:
        fully_shard(layer, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(module, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    return module


def param_groups(model: nn.Module, lr: float, lr_scale: dict[str, float]) -> list[dict]:
    """The trainable parameters as AdamW groups, one per LR multiplier of `optim.lr_scale`: a parameter's key is the
    draft module it belongs to (`draft.<key>.…`). A key that names no trainable parameter is an error (a typo would
    otherwise train the whole draft at one LR and say nothing)."""
    groups: dict[float, list[nn.Parameter]] = {}
    keys = set()
    for name, p in model.named_parameters():
        if p.requires_grad:
            parts = name.split(".")
            key = parts[1] if parts[0] == "draft" and len(parts) > 2 else parts[0]
            keys.add(key)
            groups.setdefault(lr_scale.get(key, 1.0), []).append(p)
    unknown = sorted(set(lr_scale) - keys)
    if unknown:
        raise RecipeError(f"optim.lr_scale names {unknown}, which hold no trainable parameter; the draft's: "
                          f"{sorted(keys)}")
    return [{"params": params, "lr": lr * scale} for scale, params in sorted(groups.items())]


def lr_lambda(total: int, warmup: int, min_ratio: float, budget: TimeBudget | None = None):
    """Linear warmup to 1, then cosine down to min_ratio at the last step (or, with a time budget, at its end)."""
    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = budget.fraction if budget is not None else (step - warmup) / max(1, total - warmup)
        progress = min(1.0, progress)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


class TimeBudget:
    """`train.minutes`: the run's wall budget from its start to the end of training (data and regeneration
    included; export, calibration and eval follow). Training stops when it is spent, whatever the CPU, and the LR
    cosine follows the fraction spent instead of the step count, so one recipe fills its hour on a fast Xeon and on a
    slow EPYC alike (epochs / max_steps stay an upper bound). Every rank reads rank 0's clock (one broadcast of a
    float per step), so all ranks stop after the same step; a resumed run continues the spent time from its
    checkpoint. Such a run is not step-for-step reproducible: where it stops depends on the box."""

    def __init__(self, minutes: float, started: float):
        self.total_s, self._started = minutes * 60.0, started
        self.spent_s = self._base = 0.0
        self.train_from_s: float | None = None  # the time spent when the first step began

    @property
    def fraction(self) -> float:
        """Of the time left for training when it started (the cosine spans the steps, not the data phase)."""
        if self.train_from_s is None:
            return 0.0
        return (self.spent_s - self.train_from_s) / max(1e-9, self.total_s - self.train_from_s)

    def begin(self, device) -> bool:
        """Before the first step of this process: True when nothing is left for training."""
        spent = self.tick(device)
        if self.train_from_s is None:
            self.train_from_s = self.spent_s
        return spent

    def state(self) -> dict:
        return {"train_s": self.spent_s, "train_from_s": self.train_from_s}

    def restore(self, state: dict | None) -> None:
        """Continue a checkpoint's spent time (a resumed run)."""
        state = state or {}
        self.spent_s = self._base = state.get("train_s", 0.0)
        self.train_from_s = state.get("train_from_s")

    def tick(self, device) -> bool:
        """Agree on the time spent (rank 0's); True when the budget is used up."""
        spent = torch.tensor([self._base + time.perf_counter() - self._started], dtype=torch.float64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(spent, 0)
        self.spent_s = float(spent)
        return self.spent_s >= self.total_s


class Plan:
    """Which samples each rank trains on at each step (see the module docstring)."""

    def __init__(self, samples: list[Sample], seed: int, global_batch: int, micro_batch: int, world: int):
        if global_batch % (world * micro_batch):
            raise RecipeError(f"train.global_batch={global_batch} must be divisible by world size {world} × "
                              f"micro_batch {micro_batch}")
        self.samples, self.seed, self.G, self.m, self.world = samples, seed, global_batch, micro_batch, world
        self._orders: dict[int, list[int]] = {}

    @property
    def accumulation(self) -> int:
        return self.G // (self.world * self.m)

    def item(self, position: int) -> tuple[int, Sample]:
        n = len(self.samples)
        epoch = position // n
        if epoch not in self._orders:
            self._orders = {epoch: epoch_order(n, self.seed, epoch)}
        return position, self.samples[self._orders[epoch][position % n]]

    def micro_batches(self, step: int, rank: int) -> list[list[tuple[int, Sample]]]:
        per_rank = self.G // self.world
        start = step * self.G + rank * per_rank
        items = [self.item(p) for p in range(start, start + per_rank)]
        return [items[i:i + self.m] for i in range(0, per_rank, self.m)]


def total_steps(recipe: Recipe, num_samples: int) -> int:
    t = recipe.train
    if t.max_steps is not None:
        return t.max_steps
    return max(1, math.ceil(t.epochs * num_samples / t.global_batch))


# ---- the run -----------------------------------------------------------------------------------------------
class Trainer:
    def __init__(self, recipe: Recipe, recipe_path: str | None = None, overrides: list[str] | None = None):
        self.recipe, self.recipe_path, self.overrides = recipe, recipe_path, list(overrides or [])
        self.out = Path(recipe.train.out_dir)
        self.d = init_distributed(recipe.engine.device)
        if recipe.train.world_size and recipe.train.world_size != self.d.world:
            raise RecipeError(f"recipe is planned for train.world_size={recipe.train.world_size} ranks but runs on "
                              f"{self.d.world}; launch that many or override train.world_size")
        if recipe.train.threads:
            torch.set_num_threads(recipe.train.threads)
        self.dcfg = draft_config(recipe, target_config(recipe))
        self.target_dir = resolve_target_path(recipe.target.path)
        self.main = self.d.rank == 0
        self.phase_s: dict[str, float] = {}  # wall seconds by phase (rank 0's view), printed and saved at the end
        self.started = time.perf_counter()  # train.minutes counts from here

    def log(self, msg: str) -> None:
        if self.main:
            print(msg, flush=True)

    @contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phase_s[name] = self.phase_s.get(name, 0.0) + time.perf_counter() - t0

    def report_phases(self) -> None:
        total = sum(self.phase_s.values())
        self.log("wall time by phase: " + " | ".join(f"{k} {v / 60:.1f} min" for k, v in self.phase_s.items())
                 + f" | total {total / 60:.1f} min")
        if self.main:
            (self.out / "phases.json").write_text(json.dumps({**self.phase_s, "total": total}, indent=2) + "\n")

    # -- data --
    def prepare_data(self, target) -> tuple[list[Sample], int]:
        cfg = self.recipe.data
        cache = Path(cfg.cache_dir) if cfg.cache_dir else self.out / "data"
        return prepare_samples(cfg, self.target_dir, cache, self.d.rank, self.d.world, dist.barrier,
                               target.model if target is not None else None, log=self.log)

    # -- model --
    def build_model(self, target) -> ObjectiveModule:
        torch.manual_seed(self.recipe.train.seed)  # identical init on every rank and every world size
        draft = DSparkDraft(self.dcfg)
        self.log(warm_start(draft, self.recipe.init, self.target_dir))
        if self.dcfg.reduced_vocab and not self.recipe.init.draft:  # a warm-start draft brings its own d2t
            draft.set_vocab(self.draft_vocab())
        if target is not None:
            embed, head = target.embed_tokens, target.lm_head
        else:
            embed, head = load_target_heads(self.target_dir, target_dtype(self.recipe, self.d.device), self.d.device)
        draft = draft.to(self.d.device).bind_target(embed, head)
        if draft.embed_tokens is not None and not self.recipe.init.draft:
            self.log(init_own_embedding(draft, embed))
        module = ObjectiveModule(draft, self.recipe.objective, scale_aux=self.recipe.optim.scale_aux)
        return shard(module, compute_dtype(self.recipe, self.d.device), self.recipe.train.reshard_after_forward)

    def draft_vocab(self, samples: list[Sample] | None = None) -> torch.Tensor:
        """The run's K draft tokens: built from the samples' supervised tokens (+ stop tokens) before step 0 and
        stored in out_dir/draft_vocab.json, which a resumed run or an export reads back (every rank derives the same
        set, so no broadcast is needed)."""
        path, c = self.out / "draft_vocab.json", self.dcfg
        dist.barrier()
        stored = path.exists()  # every rank decides before rank 0 writes
        dist.barrier()
        if stored:
            return load_vocab(path, c.draft_vocab, c.vocab_size)
        if samples is None:
            raise FileNotFoundError(f"{path} is missing: the run's draft vocabulary is built before step 0")
        counts = token_counts(((s.input_ids, s.loss_mask) for s in samples), c.vocab_size)
        ids = choose_vocab(counts, c.draft_vocab, stop_token_ids(self.target_dir))
        cov = coverage(counts, ids)
        if self.main:
            save_vocab(path, ids, c.vocab_size, coverage={"train": cov}, train_tokens=int(counts.sum()))
        self.log(f"draft vocabulary: {c.draft_vocab} of {c.vocab_size} tokens cover {100 * cov:.2f} % of the "
                 f"{int(counts.sum())} supervised training tokens ({path})")
        dist.barrier()
        return ids

    def run(self, resume: bool = False) -> Path:
        r = self.recipe
        if self.main:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "recipe.json").write_text(json.dumps(r.to_dict(), indent=2, default=str))
        source, procs, target = make_source(r, self.dcfg, self.d.rank, self.d.local_rank, self.d.world,
                                            pad_id=0, recipe_path=self.recipe_path, overrides=self.overrides,
                                            out_dir=self.out)
        try:
            with self.phase("data"):  # tokenise, or regenerate the responses with the target
                samples, source.pad_id = self.prepare_data(target)
            folder = self._train(samples, source, target, resume)
            self.report_phases()
            return folder
        finally:
            source.close()
            for p in procs:
                p.kill()

    def _train(self, samples: list[Sample], source, target, resume: bool) -> Path:
        r, t = self.recipe, self.recipe.train
        if self.dcfg.reduced_vocab and not r.init.draft:
            with self.phase("vocab"):
                self.draft_vocab(samples)  # before step 0; a resumed run reads the stored one back
        model = self.build_model(target)
        if r.objective.teacher_topk:  # the source keeps each sample's sparse teacher instead of its hidden states
            source.teacher_head = (model.draft.target.lm_head.weight, r.objective.teacher_topk)
        params = [p for p in model.parameters() if p.requires_grad]
        o = r.optim
        optim = torch.optim.AdamW(param_groups(model, o.lr, o.lr_scale), lr=o.lr, betas=o.betas, eps=o.eps,
                                  weight_decay=o.weight_decay)
        steps = total_steps(r, len(samples))
        warmup = round(o.warmup_ratio * steps)
        budget = TimeBudget(t.minutes, self.started) if t.minutes else None
        sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_lambda(steps, warmup, o.min_lr_ratio, budget))
        plan = Plan(samples, t.seed, t.global_batch, t.micro_batch, self.d.world)
        start = 0
        if resume:
            meta = ckpt.load_checkpoint(self.out / "checkpoints", model, optim, sched)
            if meta is not None:
                start = meta["step"]
                if budget is not None:
                    budget.restore(meta["stream"].get("budget"))
                self.log(f"resumed from step {start} ({self.out / 'checkpoints'})")
            else:
                self.log("--resume: no complete checkpoint yet, starting from step 0")
        n_params = sum(p.numel() for p in params)
        self.log(f"draft {n_params / 1e6:.2f}M params | {len(samples)} samples | {steps} steps × global batch "
                 f"{t.global_batch} ({self.d.world} ranks × {plan.accumulation} micro × {t.micro_batch}) | "
                 f"warmup {warmup} | {self.d.device}"
                 + (f" | stops {t.minutes:g} min after launch (train.minutes)" if budget else ""))
        logger = MetricLogger(r, self.out, self.main, steps, start)
        publisher = Publisher(r.publish, self.out, self.log) if r.publish.every_steps else None
        with self.phase("train"):  # steps, checkpoints and publishing
            if budget is not None and budget.begin(self.d.device) and start == 0:
                raise RecipeError(f"train.minutes={t.minutes:g} was spent before the first step (data took "
                                  f"{self.phase_s.get('data', 0) / 60:.1f} min; it is cached now): raise the budget")
            end = start if budget is not None and budget.fraction >= 1 else steps  # a spent budget: nothing to do
            for step in range(start, end):
                micro = plan.micro_batches(step, self.d.rank)
                ahead = plan.micro_batches(step + 1, self.d.rank) if step + 1 < steps else []
                source.submit([it for mb in micro + ahead for it in mb])  # engines prefetch the next step meanwhile
                metrics = self.train_step(model, params, optim, sched, step, micro, source)
                logger.step(step, metrics, o.lr * sched.lr_lambdas[0](sched.last_epoch))  # the recipe's LR
                done = step + 1
                spent = budget is not None and budget.tick(self.d.device)
                if (t.save_every and done % t.save_every == 0) or done == steps or spent:
                    ckpt.save_checkpoint(self.out / "checkpoints", done, model, optim, sched,
                                         {"position": done * t.global_batch, "epoch": done * t.global_batch //
                                          len(samples), "inflight": source.pending(),
                                          "budget": budget.state() if budget else None}, keep=t.keep_checkpoints)
                if spent:
                    self.log(f"train.minutes={t.minutes:g} spent after step {done} of at most {steps}")
                if publisher is not None and r.publish.due(done):  # export is collective; rank 0 pushes
                    folder = self.export(model, publisher.folder(done))
                    if self.main:
                        publisher.publish(folder, done)
                if spent:
                    break
            logger.close()
        with self.phase("export"):
            folder = self.export(model, self.out / "draft")
        if self.main and r.eval.calibrate_prompts:
            with self.phase("calibrate"):
                calibrate_phase(r, folder, self.out, self.log)
        if self.main and r.eval.datasets:
            with self.phase("eval"):
                final_eval(r, folder, self.out / "eval.json", self.log)
        dist.barrier()
        return folder

    def export_latest(self) -> Path:
        """On-demand export of the latest complete checkpoint (safe while a run is writing newer ones)."""
        model = self.build_model(None)
        optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda _: 1.0)
        meta = ckpt.load_checkpoint(self.out / "checkpoints", model, optim, sched, prune=False)
        if meta is None:
            raise FileNotFoundError(f"no complete checkpoint under {self.out / 'checkpoints'}")
        return self.export(model, self.out / f"draft-step-{meta['step']}")

    def train_step(self, model, params, optim, sched, step, micro, source) -> dict:
        r = self.recipe
        t0 = time.perf_counter()
        dev = self.d.device
        acc = torch.zeros(2 + len(STAT_NAMES) * self.dcfg.block_size, dtype=torch.float64, device=dev)
        tokens = 0
        for i, items in enumerate(micro):
            batch = source.batch(items, dev)
            if model.aux_inv_scale is not None and not model.aux_inv_scale.any():
                model.measure_aux_scale(batch)  # first step of a fresh run (a resumed run loads it)
            seeds = [anchor_seed(r.train.seed, step, int(s)) for s in batch.sample_ids]
            anchors, valid = sample_anchors(batch.loss_mask, batch.lengths, r.objective.num_anchors, seeds)
            model.set_requires_gradient_sync(i == len(micro) - 1)
            out = model(batch, anchors.to(dev), valid.to(dev))
            out.numerator.backward()
            acc[0] += out.numerator.detach().double()
            acc[1] += out.weight_sum.double()
            acc[2:] += out.stats.flatten().double()
            tokens += int(batch.lengths.sum())
        dist.all_reduce(acc)
        if not torch.isfinite(acc[:2]).all():
            raise FloatingPointError(f"non-finite loss at step {step}; no update was applied")
        normalise_gradients(params, acc[1], scale=self.d.world)  # FSDP averaged over ranks: undo, then / Σw
        gnorm = torch.nn.utils.clip_grad_norm_(params, r.optim.clip_grad_norm)
        gnorm = float(gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm)
        if not math.isfinite(gnorm):
            raise FloatingPointError(f"non-finite gradient norm at step {step}; no update was applied")
        optim.step()
        sched.step()
        optim.zero_grad(set_to_none=True)
        m = summarise(acc[2:].view(len(STAT_NAMES), -1).float())
        dt = time.perf_counter() - t0
        m.update(loss=float(acc[0] / acc[1]), grad_norm=gnorm, step_s=dt,
                 anchor_tokens_per_s=m["slots"] / dt, target_tokens_per_s=tokens * self.d.world / dt)
        return m

    def export(self, model, folder: Path) -> Path:
        """The canonical DSpark checkpoint folder (config.json + model.safetensors) that `dspark eval` reads."""
        state = ckpt.full_state_dict(model)
        if self.main:
            draft = DSparkDraft(self.dcfg)
            draft.load_state_dict(fold_aux_scale(state), strict=True)
            target = model.draft.target  # bound: a reduced vocabulary exports its K-row lm_head (vLLM needs it)
            draft.bind_target(target.embed_tokens, target.lm_head).save_pretrained(folder)
            self.log(f"exported draft to {folder}")
        dist.barrier()
        return folder


def calibrate_phase(recipe: Recipe, draft_dir: Path, out_dir: Path, log=print) -> None:
    """STS on held-out training prompts (the training distribution, never trained on) -> draft_dir/sts.json."""
    from dspark_sgl.evaluate import calibrate
    from dspark_sgl.loading import eos_ids, load_pair
    from dspark_sgl.speculative.engine import SpecEngine
    from training.data import heldout_prompts

    e = recipe.eval
    if e.threads:
        torch.set_num_threads(e.threads)
    prompts = heldout_prompts(recipe.data, e.calibrate_prompts)
    if not prompts:
        log("calibrate: no held-out training prompts (every source is used whole): sts.json not written")
        return
    path = out_dir / "calibration.jsonl"
    path.write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in prompts))
    target, draft, tok = load_pair(recipe.target.path, str(draft_dir), e.dtype)
    cal = calibrate(SpecEngine(target, draft), tok, [path], len(prompts), e.max_new_tokens, eos_ids(tok, target),
                    temperature=e.temperature, batch_size=e.batch_size)
    cal.save(draft_dir / "sts.json")
    log(f"calibrate: STS on {cal.fit_steps} verify steps of {len(prompts)} held-out training prompts (in-sample "
        f"ECE {[round(x, 3) for x in cal.before['ece']]} -> {[round(x, 3) for x in cal.after['ece']]}), "
        f"temperatures {[round(float(t), 2) for t in cal.temperatures]} -> {draft_dir / 'sts.json'}")


def final_eval(recipe: Recipe, draft_dir: Path, out: Path, log=print) -> dict:
    """`dspark eval` on the held-out prompts with the exported draft (T, dtype from the recipe) + the plain baseline."""
    from dspark_sgl.evaluate import evaluate_dataset, plot_acceptance, report_dict
    from dspark_sgl.loading import eos_ids, load_pair
    from dspark_sgl.speculative.engine import SamplingConfig, SpecEngine, confidence_planner

    e = recipe.eval
    if e.threads:
        torch.set_num_threads(e.threads)
    target, draft, tok = load_pair(recipe.target.path, str(draft_dir), e.dtype)
    planner = confidence_planner(target, draft, max_batch=e.batch_size) if e.schedule == "confidence" else None
    from dspark_sgl.speculative.match import MatchConfig

    engines = {"dspark": SpecEngine(target, draft, planner, match=MatchConfig() if e.match else None)}
    if e.baseline:
        engines["plain"] = SpecEngine(target, None)
    reports = {}
    sampling = SamplingConfig(temperature=e.temperature)
    for n, path in enumerate(e.datasets):
        for name, engine in engines.items():
            if name == "plain" and e.baseline == "first" and n > 0:
                continue
            rep, _ = evaluate_dataset(engine, tok, path, e.num_prompts, e.max_new_tokens, sampling,
                                      eos_ids(tok, target), e.batch_size)
            reports.setdefault(rep.name, {})[name] = rep
        spec, plain = reports[rep.name]["dspark"], reports[rep.name].get("plain")
        ratio = (f"speed ratio vs plain {spec.tokens_per_s / plain.tokens_per_s:.2f}x" if plain
                 else "plain not timed on this set")
        log(f"eval {rep.name}: τ = {spec.tau:.3f} over {spec.prompts} prompts (T={e.temperature}), "
            f"{spec.tokens_per_s:.1f} tok/s, {ratio}, per-position accept "
            f"{[round(a, 2) for a in spec.per_position_accept]}")
        log(f"wrote {plot_acceptance(spec, out.parent / f'eval.{rep.name}.accept.png')}")
    result = {name: report_dict([d[name] for d in reports.values() if name in d], draft=str(draft_dir), engine=name,
                                temperature=e.temperature, dtype=e.dtype,
                                **({"schedule": e.schedule, "match": e.match} if name == "dspark" else {}))
              for name in engines}
    out.write_text(json.dumps(result, indent=2))
    return result


class MetricLogger:
    """Console line every log_every steps, rich progress bar with ETA, wandb (offline works without network)."""

    def __init__(self, recipe: Recipe, out: Path, main: bool, total: int, start: int):
        t = recipe.train
        self.main, self.every, self.total = main, t.log_every, total
        self.file = (out / "metrics.jsonl").open("a") if main else None
        self.wandb = None
        if main and t.wandb_project and t.wandb_mode != "disabled":
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self.wandb = wandb.init(project=t.wandb_project, dir=str(out), mode=t.wandb_mode,
                                    config=recipe.to_dict(), resume="allow")
        self.progress = None
        self.line = ProgressLine("step", total, start=start)
        if main and t.progress and sys.stdout.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("[bold]train"), BarColumn(),
                                     TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                                     TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
            self.task = self.progress.add_task("train", total=total, completed=start, info="")
            self.progress.start()

    def step(self, step: int, m: dict, lr: float) -> None:
        if not self.main:
            return
        m = {"step": step + 1, "lr": lr, **m}
        self.file.write(json.dumps(m) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(m, step=step + 1)
        info = (f"loss {m['loss']:.3f} acc {m['acc']:.3f} τp {m['tau_prob']:.2f} "
                f"{m['anchor_tokens_per_s']:.0f} anchor-tok/s")
        if self.progress is not None:
            self.progress.update(self.task, completed=step + 1, info=info)
        self.line.done = step + 1
        if (step + 1) % self.every == 0 or step + 1 == self.total:
            line = (f"{self.line.line()} loss {m['loss']:.4f} ce {m['ce']:.3f} l1 {m['l1']:.3f} "
                    f"bce {m['bce']:.3f} acc {m['acc']:.3f} agree {m['teacher_agreement']:.3f} "
                    f"τp {m['tau_prob']:.3f} |g| {m['grad_norm']:.3f} lr {lr:.2e} "
                    f"{m['anchor_tokens_per_s']:.0f} anchor-tok/s")
            (self.progress.console.print if self.progress else print)(line)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.file is not None:
            self.file.close()
            try:  # a figure must never cost the run that just trained: the metrics file holds the same numbers
                plot_curves(Path(self.file.name), Path(self.file.name).with_name("curves.png"))
            except ImportError as e:
                print(f"curves.png not drawn ({e}); the curves are in {self.file.name}")
        if self.wandb is not None:
            self.wandb.finish()


def read_metrics(metrics: Path) -> dict[int, dict]:
    """metrics.jsonl as {step: record}. A resumed run's file holds some steps once per run: the last record wins."""
    return {rec["step"]: rec for rec in map(json.loads, metrics.read_text().splitlines())}


def plot_curves(metrics: Path, out: Path) -> None:
    """Loss and τ_prob (the trainer's per-step acceptance estimate) against the step, from metrics.jsonl."""
    from dspark_sgl.plots import pyplot, save_figure

    plt = pyplot()
    rows = read_metrics(metrics)
    steps = sorted(rows)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    ax1.plot(steps, [rows[s]["loss"] for s in steps], lw=0.8)
    ax1.set(xlabel="step", ylabel="loss", yscale="log", title="objective (0.1 CE + 0.9 L1 + BCE)")
    ax2.plot(steps, [rows[s]["tau_prob"] for s in steps], lw=0.8)
    ax2.set(xlabel="step", ylabel="τ_prob", title="expected accepted length (training anchors)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    save_figure(fig, out, dpi=110)


def train(recipe: Recipe, recipe_path: str | None = None, overrides: list[str] | None = None,
          resume: bool = False, export_only: bool = False) -> Path:
    trainer = Trainer(recipe, recipe_path, overrides)
    return trainer.export_latest() if export_only else trainer.run(resume=resume)
