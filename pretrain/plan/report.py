"""The plan as `pretrain plan` shows it: the text tables and lines, and the same as JSON."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from pretrain.config.ds_render import render_deepspeed
from pretrain.config.engine_sections import ZeroConfig
from pretrain.config.layout import Layout, layout_of
from pretrain.config.mix import mix_names, mix_plan, mix_points
from pretrain.config.tree import RunConfig, analytic_num_params
from pretrain.plan.layout import recomputes, stage_shares
from pretrain.plan.memory import (
    GB,
    PROCESS_HOST_GB,
    deepspeed_host_reading,
    gradient_comm_bytes,
    largest_layer_params,
)
from pretrain.plan.search import search_layouts, with_overrides
from pretrain.plan.stages import Budget, StagePlan, offload_name, plan_budget, plan_stages
from pretrain.plan.target import Target
from pretrain.plan.timing import (
    OVERLAP,
    Rates,
    bubble_fraction,
    elem_bytes,
    group_busbw,
    pp_comm_bytes,
    step_times,
    tp_comm_bytes,
)


def _gb(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def render_budget(b: Budget) -> str:
    """The plan's budget line."""
    limits = (
        f"budget: max_steps {b.max_steps:,}, max_tokens {f'{b.max_tokens:,}' if b.max_tokens else 'none'}, "
        f"max_hours {f'{b.max_hours:g}' if b.max_hours else 'none'}."
    )
    est = f"at the {b.step_s:.3g} s a step estimated below for this config" if b.step_s else ""
    if b.binds == "max_hours":
        return (
            f"{limits} schedule.max_hours binds {est}: its {b.max_hours:g} h of training end the run near step "
            f"{b.steps:,} ({b.tokens:,} tokens) of the {b.schedule_steps:,} the LR schedule spans, with a "
            "checkpoint that a resume with a larger max_hours continues"
        )
    hours = f", in {b.hours:.3g} h {est}" if b.hours is not None else ""
    unknown = " (max_hours not compared: no step time)" if b.max_hours and b.step_s is None else ""
    return (
        f"{limits} schedule.{b.binds} binds: the run ends at step {b.steps:,} ({b.tokens:,} tokens){hours}, "
        f"the LR schedule spanning those steps{unknown}"
    )


def render_mix(cfg: RunConfig) -> list[str]:
    """data.blend's mix (nothing for one dataset): fixed, or where its schedule turns."""
    blend = cfg.data.blend
    if len(blend) < 2:
        return []
    names, weights = mix_names([b.dataset_dir for b in blend]), [b.weight for b in blend]
    run_tokens = cfg.tokens_per_step * cfg.total_steps
    return mix_plan(names, weights, tokens_per_step=cfg.tokens_per_step, run_tokens=run_tokens)


def _mix_json(cfg: RunConfig) -> list[dict[str, Any]] | None:
    """render_mix's points as data: tokens, step and each dataset's share (None: one dataset)."""
    blend = cfg.data.blend
    if len(blend) < 2:
        return None
    names = mix_names([b.dataset_dir for b in blend])
    points = mix_points([b.weight for b in blend], tokens_per_step=cfg.tokens_per_step)
    return [
        {
            "tokens": int(t) if t.is_integer() else t,
            "step": step,
            "shares": dict(zip(names, shares, strict=True)),
        }
        for t, step, shares in points
    ]


def _this_config_step_s(cfg: RunConfig, world: int, rates: Rates | None) -> float | None:
    """The estimated seconds of a step at the configured ZeRO stage and offload."""
    if rates is None:
        return None
    z = cfg.zero
    chosen = (
        z.stage,
        "optimizer+params" if z.offload_param else "optimizer" if z.offload_optimizer else "none",
    )
    times = [t.step_s for t in step_times(cfg, world, rates) if (t.stage, t.offload) == chosen]
    return times[0] if times else None


def render_plan(cfg: RunConfig, to: Target, rates: Rates | None = None, *, search: bool = False) -> str:
    """The plan as `pretrain plan` prints it; the layouts that fit follow when nothing fits the
    configured one (or with `search`)."""
    world, device_gb = to.world, to.device_gb
    b, m = cfg.batch, cfg.model
    n = analytic_num_params(m)
    tbs = b.sequences
    layout = layout_of(cfg, world)
    lines = [
        f"{cfg.preset}: {n / 1e6:.2f}M parameters (Ψ), {m.arch}, {m.n_layer} layers, n_embd {m.n_embd}, "
        f"context {m.block_size}, vocab {m.vocab_size}, {cfg.precision.name}",
        f"batch: micro {b.micro_batch_size} x accumulation {b.gradient_accumulation_steps} x data-parallel "
        f"{b.data_parallel_size} = {tbs} sequences per step",
        f"tokens: {tbs * m.block_size:,} per step, {tbs * m.block_size * cfg.total_steps:,} in "
        f"{cfg.total_steps:,} steps",
        render_budget(plan_budget(cfg, _this_config_step_s(cfg, world, rates))),
        *render_mix(cfg),
        f"layout: {layout} = {world} ranks (parallel.tensor x parallel.pipeline x data-parallel)",
        *render_layout(cfg, layout),
        "",
        "DeepSpeed JSON (rendered):",
        json.dumps(render_deepspeed(cfg), indent=2),
        "",
        *([f"note: {to.note}"] if to.note else []),
        f"Memory per rank in GB, {layout}, world size {world}; device memory {_gb(device_gb)} GB "
        f"({to.device_src}); host memory {_gb(to.host_gb)} GB a node.",
        "Model states by the ZeRO paper and DeepSpeed's buffers (see `pretrain/plan/memory.py`), ZeRO sharding "
        f"over the {layout.data} data-parallel rank{'s' if layout.data > 1 else ''}; DeepSpeed's estimate assumes "
        "16-bit training summed in 16 bits (2 + 18 bytes/param), gives host memory per node, and has no estimator "
        "for stages 0 and 1.",
    ]
    pp = layout.pipeline > 1
    header = (
        "stage  offload            params  grads  optim   host | states  activ  work | device total"
        " | DS device  DS host/node | comm/step | fits | host/node | host fits"
        + (" | pipeline stage" if pp else "")
    )
    lines += [header, "-" * len(header)]
    plans = plan_stages(
        cfg,
        world,
        device_gb=device_gb,
        gpus_per_node=to.ranks_per_node,
        host_gb=to.host_gb,
        cpu_ranks=to.on_cpu,
    )
    mine = _configured(plans, zero=cfg.zero)
    for p in plans:
        mark = "*" if p is mine else " "
        row = (
            f"{mark}{p.stage:<5} {p.offload:<17} {_gb(p.params_gb):>7} {_gb(p.grads_gb):>6} "
            f"{_gb(p.optimizer_gb):>6} {_gb(p.host_gb):>6} | {_gb(p.model_states_gb):>6} "
            f"{_gb(p.activations_gb):>6} {_gb(p.working_gb):>5} | {_gb(p.device_total_gb):>12} | "
            f"{_gb(p.ds_device_gb):>9} {_gb(p.ds_host_gb):>13} | {_gb(p.comm_gb_per_step):>9} | "
            f"{_yes(p.fits):>4} | {_gb(p.host_node_gb):>9} | {_yes(p.host_fits):<9}"
            + (f" | {p.pipeline_stage}" if pp else "")
        )
        lines.append(row.rstrip())
    lines += [
        render_legend(cfg, layout),
        *render_host(cfg, to, plans),
        *render_deepspeed_host(cfg, to, plans),
    ]
    if rates is not None:
        lines += ["", *render_times(cfg, world, rates)]
        if device_gb is not None:
            lines += render_pick(cfg, to, rates, plans)
    if device_gb is not None and (search or not any(p.fits and p.host_fits is not False for p in plans)):
        lines += ["", *render_search(cfg, to, rates, fitting=not search, plans=plans)]
    return "\n".join(lines)


def render_legend(cfg: RunConfig, layout: Layout) -> str:
    """The line under the memory table that says what its columns count."""
    m, pp = cfg.model, layout.pipeline > 1
    activ = (
        f"activations of the micro batches a stage keeps in flight (1F1B: stage s keeps min(p - s, m); "
        f"activation checkpoint interval {recomputes(cfg, layout.pipeline)})"
        if pp
        else "activations of one micro batch "
        f"({'with' if m.activation_checkpointing else 'without'} activation checkpointing)"
    )
    p = cfg.precision
    summed = (
        f" Gradients summed over the micro batches in {p.grad_accum_dtype} (precision.grad_accum_dtype), "
        "at stage 0 in bf16 (DeepSpeed's stage 0 sums no bf16 gradient in fp32); at stage 1 without offload "
        "DeepSpeed's BF16_Optimizer keeps a whole fp32 gradient buffer beside the bf16 gradients."
        if p.bf16 and p.accumulates_in_fp32
        else f" Gradients summed in {p.grad_accum_dtype} (precision.grad_accum_dtype)."
        if p.bf16
        else ""
    )
    return (
        f"* this config. Each row is the rank that needs the most memory{' (its pipeline stage last)' if pp else ''}. "
        f"activ: {activ}. work: DeepSpeed's gradient reduction buffers, and BF16_Optimizer's all-reduce copy "
        "after backward (counted against the activations it outlives: the larger of the two); stage 3's gathered "
        "largest layer is in params and grads. comm: what each rank sends per optimizer step for ZeRO (2Ψ "
        "stages 0-2, 3Ψ stage 3, Ψ the rank's parameters, per micro step where the stage reduces each one), "
        f"{_comm_bytes_legend(cfg)}. host/node: a node's ranks' host memory from the start (the process, the "
        f"model where the host is the device, the offloaded states); host fits: it fits the node's.{summed}"
    )


def _comm_bytes_legend(cfg: RunConfig) -> str:
    """The bytes the comm column counts an element at: a gradient in the dtype it is reduced in
    (`memory.gradient_comm_bytes`), a parameter in its own."""
    grads, stage0 = gradient_comm_bytes(cfg, 1), gradient_comm_bytes(cfg, 0)
    at_zero = f" ({stage0} at stage 0)" if stage0 != grads else ""
    return f"a gradient at {grads} bytes{at_zero}, a parameter at {elem_bytes(cfg.precision.name)}"


def _configured(plans: list[StagePlan], *, zero: ZeroConfig) -> StagePlan | None:
    """The row of `plans` at the configured ZeRO stage and offload."""
    z = zero
    mine = (z.stage, offload_name(z.offload_optimizer, z.offload_param))
    return next((p for p in plans if (p.stage, p.offload) == mine), None)


def render_host(cfg: RunConfig, to: Target, plans: list[StagePlan]) -> list[str]:
    """One line: the configured rank's host memory from the start, a node's, and whether its host holds
    it; when not, what would (`host_fixes`)."""
    p = _configured(plans, zero=cfg.zero)
    if p is None:
        return []
    process = "torch and DeepSpeed" if to.on_cpu else "torch, DeepSpeed and a CUDA context"
    model = (
        f"the model {_gb(p.host_model_gb)}, the host being the CPU ranks' device"
        if to.on_cpu
        else "the model 0, built on the GPU"
    )
    parts = (
        f"a rank {_gb(p.host_rank_gb)} GB: its process {_gb(p.host_process_gb)}, assumed for {process} "
        f"(memory.PROCESS_HOST_GB); {model}; offloaded states {_gb(p.host_gb)}"
    )
    need = f"a node's {p.node_ranks} ranks take {_gb(p.host_node_gb)} GB of host memory from the start"
    if p.host_snapshot_node_gb:
        need += (
            f", and {_gb(p.host_snapshot_node_gb)} GB more while a checkpoint is written in the background "
            f"(checkpoint.async_save: {_gb(p.host_snapshot_gb)} GB on the rank that writes the weights)"
        )
    if to.host_gb is None:
        return [f"host: {need} ({parts}); the host's own is unknown: pass --host-gb."]
    if p.host_fits:
        if p.host_node_gb + p.host_snapshot_node_gb > to.host_gb:
            need += (
                " (the snapshot does not fit beside it: a save then writes what does not fit synchronously, "
                "or set checkpoint.async_save=false)"
            )
        return [f"host: {need}, of its {_gb(to.host_gb)} GB ({parts})."]
    fixes = "; or ".join(host_fixes(cfg, to, plans, p))
    return [f"host does not fit: {need}, more than its {_gb(to.host_gb)} GB ({parts}). Fix: {fixes}."]


def render_deepspeed_host(cfg: RunConfig, to: Target, plans: list[StagePlan]) -> list[str]:
    """One line: the configured row's host memory a node beside DeepSpeed's estimate (`DS host/node`),
    and what each counts (`memory.deepspeed_host_reading`); nothing where DeepSpeed gives none."""
    p = _configured(plans, zero=cfg.zero)
    if p is None or p.ds_host_gb is None:
        return []
    reading = deepspeed_host_reading(
        p.rank_params, largest_layer_params(cfg), stage=p.stage, world=to.world,
        gpus_per_node=to.ranks_per_node or min(to.world, 8), offload_optimizer=p.offload != "none",
        offload_param=p.offload == "optimizer+params",
    )  # fmt: skip
    if reading is None:
        return []
    _, counts = reading
    model = (
        f"{_gb(p.host_model_gb)} model (the host is the CPU ranks' device)"
        if to.on_cpu
        else "0 model (built on the GPU, so no rank holds a copy on the host)"
    )
    return [
        f"host vs DeepSpeed: DeepSpeed's {_gb(p.ds_host_gb)} GB a node for ZeRO-{p.stage} {p.offload} (DS host/node) "
        f"is {counts}; the plan's {_gb(p.host_node_gb)} GB is a node's {p.node_ranks} rank{'s' if p.node_ranks > 1 else ''} "
        f"x ({_gb(p.host_process_gb)} "
        f"process, which DeepSpeed leaves out + {model} + {_gb(p.host_gb)} offloaded: the rank's own partition), "
        "with no buffer factor."
    ]


def ranks_a_host(most: int, world: int, tensor: int) -> int:
    """The most ranks up to `most` a host can run that divide the world into whole hosts, whole tensor
    groups a host where it can hold one (tensor parallel's all-reduces stay on a node's bus); 0: none."""
    fits = [k for k in range(min(most, world), 0, -1) if world % k == 0]
    return next((k for k in fits if k % tensor == 0), fits[0] if fits else 0)


def host_fixes(cfg: RunConfig, to: Target, plans: list[StagePlan], mine: StagePlan) -> list[str]:
    """What would make a node's ranks fit its host: another ZeRO stage or offload of this layout that
    fits the device and the host as it is (the first in `VARIANTS` order the config allows); fewer
    ranks a host, at this stage and offload or else at the one fitting the device that takes the
    least host memory; or, where one rank alone does not fit, a larger host."""
    rows: list[tuple[StagePlan, list[str]]] = [(mine, [])] + [
        (p, over)
        for p in plans
        if p is not mine and p.fits and (over := _variant_overrides(cfg, to.world, p)) is not None
    ]
    fixes = [_said(p, over) for p, over in rows[1:] if p.host_fits][:1]
    least = min(rows, key=lambda r: r[0].host_rank_gb)
    tries: list[tuple[StagePlan, list[str]]] = [(mine, [])] if mine.fits or least[0] is mine else []
    for row, sets in [*tries, least]:
        per_host = ranks_a_host(int((to.host_gb or 0.0) // row.host_rank_gb), to.world, cfg.parallel.tensor)
        if per_host:
            with_sets = f"{_said(row, sets)} with " if sets else ""
            return [*fixes, f"{with_sets}{per_host} rank{'s' if per_host > 1 else ''} a host (slots={per_host} "
                    f"in the hostfile: {to.world // per_host} hosts for the {to.world} ranks)"]  # fmt: skip
    row, sets = least
    return [
        *fixes,
        f"hosts of {_gb(row.host_rank_gb)} GB a rank or more"
        + (f", with {_said(row, sets)}" if sets else ""),
    ]


def _variant_overrides(cfg: RunConfig, world: int, p: StagePlan) -> list[str] | None:
    """The `--set` overrides that give row `p`'s ZeRO stage and offload; None where the tree refuses them."""
    z = cfg.zero
    off, par = p.offload != "none", p.offload == "optimizer+params"
    over = [f"zero.stage={p.stage}"] if p.stage != z.stage else []
    over += [f"zero.offload_optimizer={str(off).lower()}"] if off != z.offload_optimizer else []
    over += [f"zero.offload_param={str(par).lower()}"] if par != z.offload_param else []
    return over if with_overrides(cfg, world, over) is not None else None


def _said(p: StagePlan, over: list[str]) -> str:
    """A row as the overrides that give it, and what it takes."""
    return " ".join(f"--set {o}" for o in over) + (
        f" (ZeRO-{p.stage} {p.offload}: {_gb(p.device_total_gb)} GB a device, {_gb(p.host_rank_gb)} GB of host "
        "memory a rank)"
    )


def render_layout(cfg: RunConfig, layout: Layout) -> list[str]:
    """What each rank holds under a model-parallel layout (nothing to say without one)."""
    if layout.tensor * layout.pipeline == 1:
        return []
    lines = []
    if layout.tensor > 1:
        lines.append(
            f"  tensor: each rank holds 1/{layout.tensor} of every block's four matrices, heads and MLP width "
            "(AutoTP); the norms, embeddings and lm_head whole"
        )
    shares = stage_shares(cfg, layout)
    if layout.pipeline > 1:
        parts = [
            f"{sh.index}: {'embedding + ' if sh.first else ''}{sh.blocks} blocks{' + head' if sh.last else ''}, "
            f"{sh.params / 1e9:.3g}B"
            for sh in shares
        ]
        lines.append(
            f"  pipeline stages (partition '{cfg.parallel.partition_method}'; parameters a rank): "
            + "; ".join(parts)
        )
    else:
        lines.append(f"  parameters a rank: {shares[0].params / 1e9:.3g}B")
    return lines


def _yes(x: bool | None) -> str:
    return "-" if x is None else "yes" if x else "NO"


def render_times(cfg: RunConfig, world: int, rates: Rates) -> list[str]:
    m, b = cfg.model, cfg.batch
    layout = layout_of(cfg, world)
    total_tokens = b.sequences * m.block_size * cfg.total_steps
    src = rates.sources
    node = (
        f"; within a node {rates.node_busbw / 1e9:.3g} GB/s ({src.get('node_busbw', 'given')})"
        if rates.node_busbw is not None and rates.node_busbw != rates.busbw
        else ""
    )
    lines = [
        f"Time per step, {layout}, world size {world}: peak {rates.peak_tflops:.3g} TFLOP/s a rank ({src['peak']}); "
        f"MFU of forward+backward {rates.mfu:.2f} ({src['mfu']}); all-reduce bus bandwidth "
        f"{rates.busbw / 1e9:.3g} GB/s ({src['busbw']}){node}; optimizer {rates.optimizer_s_per_param * 1e9:.3g} ns "
        f"a parameter, {rates.host_optimizer_s_per_param * 1e9:.3g} on the host ({src['optimizer']}).",
    ]
    header = (
        "ZeRO    offload            compute  TP comm  PP comm   bubble   comm  exposed  optimizer     PCIe |"
        "   step s |    tokens/s | days"
    )
    lines += [header, "-" * len(header)]
    chosen = (cfg.zero.stage, cfg.zero.offload_optimizer, cfg.zero.offload_param)
    times = step_times(cfg, world, rates)
    for t in times:
        mark = "*" if (t.stage, t.offload != "none", t.offload == "optimizer+params") == chosen else " "
        lines.append(
            f"{mark}ZeRO-{t.stage:<2} {t.offload:<17} {t.compute_s:>8.3g} {t.tp_comm_s:>8.3g} {t.pp_comm_s:>8.3g} "
            f"{t.bubble_s:>8.3g} {t.comm_s:>6.3g} {t.exposed_comm_s:>8.3g} "
            f"{t.optimizer_s:>10.3g} {t.offload_s:>8.3g} | {t.step_s:>8.3g} | {t.tokens_per_s:>11,.0f} | {t.days:.4g}"
        )
    lines.append(
        (
            f"days: to train schedule.max_steps = {cfg.total_steps:,} steps ({total_tokens:,} tokens). "
            if cfg.schedule.binding(cfg.tokens_per_step) == "max_steps"
            else f"days: to train schedule.max_tokens = {cfg.schedule.max_tokens:,} tokens ({cfg.total_steps:,} "
            "steps). "
        )
        + "Seconds per optimizer step on the slowest pipeline stage; comm: ZeRO's over the data-parallel group; "
        f"exposed: the part of it compute does not hide ({OVERLAP:.0%} of the phase it is issued in hides it: "
        "stage 2's reduce-scatters in each micro batch's backward, stage 3's gathers in its forward and backward); "
        + (
            f"PCIe: offload's copies between a GPU and its host at {rates.pcie_bw / 1e9:.3g} GB/s (assumed), "
            "not overlapped."
            if rates.pcie_bw is not None
            else "PCIe: none, the host being the device."
        )
    )
    if times and times[0].core_share < 1:
        ranks = min(world, rates.ranks_per_node or world)
        lines.append(
            f"cores: {ranks} ranks share {rates.cores_per_node} CPU cores, {times[0].core_share:.2g} of a core each "
            "while all compute; a step takes at least the ranks' mean work over that share (the bubble's idle "
            "time goes to the other ranks), and the optimizer steps on every rank at once."
        )
    if layout.tensor > 1:
        lines.append(_tp_comm_line(cfg, layout, rates))
    if layout.pipeline > 1:
        lines += _pipeline_lines(cfg, layout, rates)
    return lines


def render_pick(cfg: RunConfig, to: Target, rates: Rates, plans: list[StagePlan]) -> list[str]:
    """One line: the ZeRO stage and offload to pick for this model and these GPUs, and why: the fastest
    predicted step among the rows that fit the device and the host (within 1% of it, the lowest stage
    and the least offload), beside the best row of each other stage and what it loses by."""
    fits = {(p.stage, p.offload): p for p in plans}
    times = step_times(cfg, to.world, rates)
    fitting = [
        t
        for t in times
        if fits[(t.stage, t.offload)].fits and fits[(t.stage, t.offload)].host_fits is not False
    ]
    if not fitting:
        return ["pick: none of these stages fits; see the layouts that fit below."]
    fastest = min(t.step_s for t in fitting)
    best = min(
        (t for t in fitting if t.step_s <= fastest * 1.01),
        key=lambda t: (t.offload != "none", t.offload, t.stage),
    )
    mine = fits[(best.stage, best.offload)]
    gpus = (
        f"{to.world} CPU ranks"
        if to.on_cpu
        else f"{to.world} x {to.device_src.split(': ')[-1]}"
        if to.device_src
        else f"{to.world} ranks"
    )
    a_device = "a rank" if to.on_cpu else "a GPU"
    others = []
    for stage in sorted({t.stage for t in times} - {best.stage}):
        rows = [t for t in times if t.stage == stage]
        ok = [t for t in rows if t in fitting]
        if not ok:
            p = min((fits[(t.stage, t.offload)] for t in rows), key=lambda p: p.device_total_gb)
            why = (
                f"does not fit ({_gb(p.device_total_gb)} GB {a_device})"
                if not p.fits
                else f"does not fit the host ({_gb(p.host_node_gb)} GB a node)"
            )
            others.append(f"ZeRO-{stage} {why}")
            continue
        t = min(ok, key=lambda t: t.step_s)
        parts = {
            "exposed communication": t.exposed_comm_s - best.exposed_comm_s,
            "optimizer step": t.optimizer_s - best.optimizer_s,
            "PCIe copies": t.offload_s - best.offload_s,
        }
        cause, extra = max(parts.items(), key=lambda kv: kv[1])
        because = f" (+{extra:.3g} s {cause})" if extra > 0 and t.step_s > best.step_s else ""
        others.append(f"ZeRO-{stage} {t.offload} {t.step_s:.3g} s{because}")
    why = (
        "it is the fastest that fits"
        if best.step_s == fastest
        else "it is the lowest stage and least offload within 1% of the fastest that fits"
    )
    return [
        f"pick: ZeRO-{best.stage} {best.offload} for this model on {gpus}, because {why}: "
        f"{best.step_s:.3g} s a step, {_gb(mine.device_total_gb)} GB {a_device}, {_gb(mine.host_node_gb)} GB of host "
        f"a node" + (f"; {', '.join(others)}." if others else ".")
    ]


def _tp_comm_line(cfg: RunConfig, layout: Layout, rates: Rates) -> str:
    """What tensor parallel's all-reduces move a step, and at what bandwidth."""
    m, b = cfg.model, cfg.batch
    x = b.micro_batch_size * m.block_size * m.n_embd
    tp = layout.tensor
    per_block = 4 + (2 if recomputes(cfg, layout.pipeline) else 0)
    gb = max(tp_comm_bytes(cfg, layout, sh) for sh in stage_shares(cfg, layout)) / GB
    return (
        f"TP comm: {per_block} all-reduces a block a micro batch (2 forward, 2 backward"
        f"{', 2 in the recomputed forward' if per_block > 4 else ''}) of micro x block x n_embd = {x:,} "
        f"values, a ring moving 2(t - 1)/t = {2 * (tp - 1) / tp:.3g} of each, at "
        f"{group_busbw(rates, tp) / 1e9:.3g} GB/s ({'within a node' if _on_node(rates, tp) else 'across nodes'}): "
        f"{gb:.3g} GB a step (counted 2X), on the critical path."
    )


def _pipeline_lines(cfg: RunConfig, layout: Layout, rates: Rates) -> list[str]:
    """The pipeline's bubble, and what its stages send each other a step."""
    m, b = cfg.model, cfg.batch
    x = b.micro_batch_size * m.block_size * m.n_embd
    p, mb = layout.pipeline, b.gradient_accumulation_steps
    f = bubble_fraction(layout, mb)
    gb = max(pp_comm_bytes(cfg, layout, sh) for sh in stage_shares(cfg, layout)) / GB
    return [
        f"bubble: (p - 1) / (m + p - 1) = {p - 1} / ({mb} + {p - 1}) = {f:.1%} of the pipeline's time idle "
        f"(m: batch.gradient_accumulation_steps{'; fewer than 4 x p micro batches: raise it' if mb < 4 * p else ''}).",
        f"PP comm: each micro batch's activations to the next stage and their gradients back, {x:,} values "
        f"each{', and the tied embedding gradient between the first and last stage' if m.tie_embeddings else ''}, "
        f"at {group_busbw(rates, layout.world) / 1e9:.3g} GB/s: {gb:.3g} GB a step on the busiest stage.",
    ]


def _on_node(rates: Rates, span: int) -> bool:
    return rates.ranks_per_node is not None and span <= rates.ranks_per_node


SEARCH_SHOWN = 5


def render_search(
    cfg: RunConfig, to: Target, rates: Rates | None, *, fitting: bool, plans: list[StagePlan]
) -> list[str]:
    """The layouts that fit (`search_layouts`), after what does not fit the configured one (`plans`)."""
    found, tried = search_layouts(cfg, to, rates)
    host_bound = to.host_gb is not None and any(p.fits for p in plans)  # the device would hold a row
    said = (
        f"Nothing fits {layout_of(cfg, to.world)} on {_gb(to.device_gb)} GB devices"
        + (f" and {_gb(to.host_gb)} GB hosts." if host_bound else ".")
        if fitting
        else f"Layouts on {to.world} ranks of {_gb(to.device_gb)} GB."
    )
    if not found:
        fix = (
            "the host line above says what would fit"
            if host_bound
            else "more ranks, or a smaller micro batch"
        )
        return [f"{said} No layout of the {tried} searched fits either (tensor 1-8 within a node, pipeline "
                f"stages dividing the nodes or layers, ZeRO 0-3, activation checkpointing): {fix}."]  # fmt: skip
    lines = [
        f"{said} Layouts that fit, fastest first ({min(len(found), SEARCH_SHOWN)} of the {len(found)} that fit, "
        f"the fastest micro batch and checkpointing of each, of {tried} searched; the global batch of {cfg.batch.sequences} sequences kept):",
        "layout               ZeRO    offload           device GB |   step s |      days | --set",
    ]
    for o in found[:SEARCH_SHOWN]:
        step = "-" if o.step_s is None else f"{o.step_s:.3g}"
        days = "-" if o.days is None else f"{o.days:.4g}"
        lines.append(
            f"{o.layout:<20} ZeRO-{o.stage:<2} {o.offload:<17} {_gb(o.device_total_gb):>9} | {step:>8} | "
            f"{days:>9} | " + " ".join(f"--set {s}" for s in o.overrides)
        )
    return lines


def plan_json(
    cfg: RunConfig, to: Target, rates: Rates | None = None, *, search: bool = False
) -> dict[str, Any]:
    layout = layout_of(cfg, to.world)
    plans = plan_stages(
        cfg, to.world, device_gb=to.device_gb, gpus_per_node=to.ranks_per_node, host_gb=to.host_gb,
        cpu_ranks=to.on_cpu,
    )  # fmt: skip
    mine = _configured(plans, zero=cfg.zero)
    out: dict[str, Any] = {
        "params": analytic_num_params(cfg.model),
        "world_size": to.world,
        "layout": {"tensor": layout.tensor, "pipeline": layout.pipeline, "data": layout.data},
        "pipeline_stages": [asdict(s) for s in stage_shares(cfg, layout)],
        "device_gb": to.device_gb,
        "device_source": to.device_src,
        "host_gb": to.host_gb,
        "note": to.note or None,
        "stages": [asdict(p) for p in plans],
        "process_host_gb": PROCESS_HOST_GB["cpu" if to.on_cpu else "cuda"],  # a rank's, assumed
        "host_vs_deepspeed": next(iter(render_deepspeed_host(cfg, to, plans)), None),
        "host_fixes": host_fixes(cfg, to, plans, mine)
        if mine is not None and mine.host_fits is False
        else [],
    }
    out["budget"] = asdict(plan_budget(cfg, _this_config_step_s(cfg, to.world, rates)))
    out["data_mix"] = _mix_json(cfg)
    if rates is not None:
        out["rates"] = asdict(rates)
        out["step_times"] = [asdict(t) for t in step_times(cfg, to.world, rates)]
        out["pick"] = (
            next(iter(render_pick(cfg, to, rates, plans)), None) if to.device_gb is not None else None
        )
    out["layouts_that_fit"] = None  # searched when nothing fits, or asked
    if to.device_gb is not None and (search or not any(p.fits and p.host_fits is not False for p in plans)):
        found, tried = search_layouts(cfg, to, rates)
        out["layouts_that_fit"] = [asdict(o) for o in found]
        out["layouts_searched"] = tried
    return out
