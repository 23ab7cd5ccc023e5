"""The settings sections of a config, one parser each: [network], [ps], [wsp], [checkpoint], [model], [data],
[train], [emulation], [allocation]; schedule and aggregation names are checked against their registries."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, get_args

from hetpipe.core.config.messages import _show
from hetpipe.core.config.schema import (
    BUILTIN_LOSSES,
    AllocationConfig,
    AllocationPolicy,
    BufferPolicy,
    CheckpointConfig,
    DataConfig,
    EmulatedDevice,
    EmulationConfig,
    ModelConfig,
    NetworkConfig,
    OnNan,
    OnVwFailure,
    OptimizerName,
    Placement,
    Precision,
    PsAgent,
    PsAuth,
    PsConfig,
    PullMode,
    TrainConfig,
    WireDtype,
    WspConfig,
)
from hetpipe.core.config.table import _Table
from hetpipe.core.errors import UsageError, did_you_mean
from hetpipe.core.imports import import_target
from hetpipe.core.pipeline.lr_schedule import LrScheduleName
from hetpipe.core.pipeline.schedule import SCHEDULES
from hetpipe.core.wsp.aggregation import AGGREGATIONS
from hetpipe.core.wsp.freezing import FreezeSchedule

_MAX_PORT = 65535


def _network(t: _Table) -> NetworkConfig:
    d = NetworkConfig()
    return NetworkConfig(
        intra_node_gbps=t.number("intra_node_gbps", d.intra_node_gbps, gt=0),
        inter_node_gbps=t.number("inter_node_gbps", d.inter_node_gbps, gt=0),
    )


def _ps(t: _Table) -> PsConfig:
    d = PsConfig()
    host = t.string("host", d.host, nonempty=True)
    port = t.integer("port", d.port, ge=1024, le=_MAX_PORT)
    shards = t.integer("shards", d.shards, ge=1)
    last = port + shards - 1
    if last > _MAX_PORT:
        t.fail(
            "port",
            f"{shards} shards from port {port} need ports up to {last}, above {_MAX_PORT}",
            f"set port to at most {_MAX_PORT + 1 - shards}, or use fewer shards",
        )
    heartbeat = t.number("heartbeat_s", d.heartbeat_s, ge=0)
    hung = t.number("hung_after_s", d.hung_after_s, ge=0)
    if hung and (not heartbeat or hung < 2 * heartbeat):
        t.fail(
            "hung_after_s",
            f"{hung:g} s with heartbeat_s = {heartbeat:g}: a stage would be declared hung "
            "between two heartbeats",
            "set hung_after_s to at least twice heartbeat_s (or 0 to never declare a stage hung)",
        )
    return PsConfig(
        host=host,
        port=port,
        shards=shards,
        placement=t.choice("placement", d.placement, get_args(Placement)),
        timeout_s=t.number("timeout_s", d.timeout_s, gt=0),
        aggregation=t.registered("aggregation", d.aggregation, AGGREGATIONS),
        buffers=t.choice("buffers", d.buffers, get_args(BufferPolicy)),
        auth=t.choice("auth", d.auth, get_args(PsAuth)),
        keys_dir=t.string("keys_dir", d.keys_dir),
        on_vw_failure=t.choice("on_vw_failure", d.on_vw_failure, get_args(OnVwFailure)),
        heartbeat_s=heartbeat,
        hung_after_s=hung,
        max_restarts=t.integer("max_restarts", d.max_restarts, ge=0),
        wire_dtype=t.choice("wire_dtype", d.wire_dtype, get_args(WireDtype)),
        agent=t.choice("agent", d.agent, get_args(PsAgent)),
        node_aggregation=t.boolean("node_aggregation", d.node_aggregation),
    )


def _wsp(t: _Table) -> WspConfig:
    d = WspConfig()
    return WspConfig(
        staleness=t.integer("staleness", d.staleness, ge=0),
        nm=t.integer("nm", d.nm, ge=1),
        pull=t.choice("pull", d.pull, get_args(PullMode)),
    )


def _checkpoint(t: _Table, default_dir: str) -> CheckpointConfig:
    d = CheckpointConfig()
    return CheckpointConfig(
        dir=t.string("dir", default_dir),
        every=t.integer("every", d.every, ge=0),
        keep=t.integer("keep", d.keep, ge=1),
        stages=t.boolean("stages", d.stages),
    )


def _model(t: _Table) -> ModelConfig:
    d = ModelConfig()
    return ModelConfig(
        name=t.string("name", d.name, nonempty=True),
        options=t.options("options"),
        init=t.string("init", d.init),
    )


def _data(t: _Table) -> DataConfig:
    d = DataConfig()
    return DataConfig(
        name=t.string("name", d.name, nonempty=True),
        options=t.options("options"),
        test_fraction=t.number("test_fraction", d.test_fraction, gt=0, lt=1),
    )


def _train(t: _Table, run_name: str) -> TrainConfig:
    d = TrainConfig()
    train = TrainConfig(
        batch_size=t.integer("batch_size", d.batch_size, ge=1),
        waves=t.integer("waves", d.waves, ge=1),
        optimizer=t.choice("optimizer", d.optimizer, get_args(OptimizerName)),
        lr=t.number("lr", d.lr, gt=0),
        momentum=t.number("momentum", d.momentum, ge=0, lt=1),
        weight_decay=t.number("weight_decay", d.weight_decay, ge=0),
        weight_stashing=t.boolean("weight_stashing", d.weight_stashing),
        schedule=t.registered("schedule", d.schedule, SCHEDULES),
        recompute=t.boolean("recompute", d.recompute),
        precision=t.choice("precision", d.precision, get_args(Precision)),
        eval_every=t.integer("eval_every", d.eval_every, ge=0),
        eval_samples=t.integer("eval_samples", d.eval_samples, ge=0),
        out_dir=t.string("out_dir", f"runs/{run_name}", nonempty=True),
        on_nan=t.choice("on_nan", d.on_nan, get_args(OnNan)),
        mitigation=t.string("mitigation", d.mitigation, nonempty=True),
        warmup_waves=t.integer("warmup_waves", d.warmup_waves, ge=0),
        clip_grad_norm=t.number("clip_grad_norm", d.clip_grad_norm, ge=0),
        freeze_cache_mib=t.integer("freeze_cache_mib", d.freeze_cache_mib, ge=0),
        autofreeze_every=t.integer("autofreeze_every", d.autofreeze_every, ge=0),
        autofreeze_rate=t.number("autofreeze_rate", d.autofreeze_rate, gt=0),
        autofreeze_ceiling=t.number("autofreeze_ceiling", d.autofreeze_ceiling, gt=0, lt=1),
        loss=_loss(t, d.loss),
    )
    train = replace(train, freeze=_freeze(t, train.waves), **_lr_schedule(t, train.waves, train.lr))
    if train.autofreeze_rate > 1:
        t.fail(
            "autofreeze_rate",
            f"is {train.autofreeze_rate}: it is the share of the trainable layers one decision may freeze",
            f"set autofreeze_rate to a number in (0, 1] {t.under}, e.g. 0.5",
        )
    if train.freeze and train.autofreeze_every:
        t.fail(
            "autofreeze_every",
            f"is {train.autofreeze_every}, but freeze lists freeze points too: the two rules would decide "
            "the same layers",
            "keep one: remove freeze (the adaptive rule), or set autofreeze_every = 0 (the fixed schedule)",
        )
    try:
        train = replace(train, mitigation="+".join(train.mitigations) or "none")
    except UsageError as exc:
        t.fail("mitigation", f"cannot read {_show(train.mitigation)}", str(exc))
    kind = SCHEDULES[train.schedule]
    if kind.stashing == "required" and not train.weight_stashing:
        optional = " or ".join(f'"{n}"' for n, k in SCHEDULES.items() if k.stashing == "optional")
        t.fail(
            "weight_stashing",
            f'is false, but schedule "{train.schedule}" keeps two weight versions by design',
            f"set weight_stashing = true {t.under}, or choose schedule = {optional} (stashing optional)",
        )
    if train.recompute and not kind.recompute:
        able = ", ".join(n for n, k in SCHEDULES.items() if k.recompute)
        t.fail(
            "recompute",
            f'is true, but schedule "{train.schedule}" updates weights between a forward and its '
            "backward, so a recomputed forward would not match the first",
            f"set recompute = false {t.under}, or choose a schedule that flushes: {able}",
        )
    return train


def _freeze(t: _Table, waves: int) -> tuple[tuple[int, int], ...]:
    """Freeze points [[wave, layers], ...] (hetpipe.core.wsp.freezing); the layer count is checked against the
    model where it is built (hetpipe.compute.build.vw_layouts)."""
    value = t.data.get("freeze", [])
    example = "[[10, 2], [20, 4]]"
    if not isinstance(value, list) or not all(isinstance(pair, list) for pair in value):
        t._type_error("freeze", value, "an array of [wave, layers] pairs", example)
    try:
        schedule = FreezeSchedule.of(value, None, waves, "freeze")
    except ValueError as exc:
        t.fail("freeze", str(exc).removeprefix("freeze"), f"write `freeze = {example}` {t.under}")
    return tuple((p.wave, p.layers) for p in schedule.points)


def _loss(t: _Table, default: str) -> str:
    """A built-in loss's name, or "package.module:function" that imports and is callable."""
    name = t.string("loss", default, nonempty=True)
    if name in BUILTIN_LOSSES:
        return name
    if ":" not in name:
        t.fail(
            "loss",
            f"unknown loss {_show(name)}",
            f"choose one of: {', '.join(BUILTIN_LOSSES)}{did_you_mean(name, BUILTIN_LOSSES)}, or name your "
            'own as "package.module:function" (called as fn(output, target) -> a 0-d tensor)',
        )
    try:
        import_target(name, f"train.loss {_show(name)}")
    except UsageError as exc:
        t.fail("loss", f"cannot use {_show(name)}", str(exc))
    return name


_LR_KEYS = {"cosine": ("warmup_steps", "total_steps", "min_lr"), "step": ("lr_step_every", "lr_step_gamma")}


def _lr_schedule(t: _Table, waves: int, lr: float) -> dict[str, Any]:
    """lr_schedule and the settings of the schedule it names; another schedule's setting (not at its default)
    is refused."""
    d = TrainConfig()
    name = t.choice("lr_schedule", d.lr_schedule, get_args(LrScheduleName))
    for other, keys in _LR_KEYS.items():
        for key in keys:
            if other != name and t.data.get(key, getattr(d, key)) != getattr(d, key):
                t.fail(
                    key,
                    f'is a setting of lr_schedule = "{other}", but lr_schedule is "{name}"',
                    (f'set lr_schedule = "{other}" {t.under}, or remove {key}'),
                )
    out: dict[str, Any] = {"lr_schedule": name}
    if name == "cosine":
        out.update(
            warmup_steps=t.integer("warmup_steps", d.warmup_steps, ge=0),
            total_steps=t.integer("total_steps", d.total_steps, ge=0),
            min_lr=t.number("min_lr", d.min_lr, ge=0),
        )
        if out["min_lr"] > lr:
            t.fail(
                "min_lr",
                f"is {out['min_lr']:g}, above lr = {lr:g}",
                f"set min_lr to at most {lr:g} {t.under}",
            )
        total = out["total_steps"] or waves
        if out["warmup_steps"] >= total:
            what = (
                f"total_steps = {total}" if out["total_steps"] else f"the run's {waves} waves (train.waves)"
            )
            t.fail(
                "warmup_steps",
                f"is {out['warmup_steps']}, not below {what}: the warm-up would never end",
                f"set warmup_steps below {total} {t.under} (a step is a wave), or raise total_steps",
            )
    elif name == "step":
        out.update(
            lr_step_every=t.integer("lr_step_every", ge=1),
            lr_step_gamma=t.number("lr_step_gamma", d.lr_step_gamma, gt=0),
        )
        if out["lr_step_gamma"] > 1:
            t.fail(
                "lr_step_gamma",
                f"is {out['lr_step_gamma']:g}: each step would raise the learning rate",
                f"set lr_step_gamma to a factor in (0, 1] {t.under}, e.g. 0.1",
            )
    return out


def _emulation(t: _Table) -> EmulationConfig:
    d = EmulationConfig()
    enabled = t.boolean("enabled", d.enabled)
    raw = t.data.get("time_scale", "auto")
    if isinstance(raw, str):
        if raw != "auto":
            t.fail(
                "time_scale",
                f"unknown value {_show(raw)}",
                f'write time_scale = "auto" or a number > 0{did_you_mean(raw, ["auto"])}',
            )
        time_scale = None
    else:
        time_scale = t.number(
            "time_scale", placeholder='"auto" or <float > 0>', kind='"auto" or a number', gt=0
        )
    return EmulationConfig(
        enabled=enabled,
        time_scale=time_scale,
        link_bandwidth=t.boolean("link_bandwidth", d.link_bandwidth),
        device=t.choice("device", d.device, get_args(EmulatedDevice)),
    )


def _allocation(t: _Table, listed: bool) -> AllocationConfig:
    policy = t.choice("policy", "explicit" if listed else "np", get_args(AllocationPolicy))
    if policy == "explicit" and not listed:
        t.fail(
            "policy",
            'is "explicit" but no [[virtual_workers]] are listed',
            'add [[virtual_workers]] tables with gpus = ["n0:0", ...], or set policy = "np", "ed", "hd" '
            'or "dp"',
        )
    return AllocationConfig(policy=policy)
