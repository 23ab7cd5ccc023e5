"""Tests for hetpipe/config.py: the packaged default, each section's round trip, and every error's message."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest

from hetpipe.core.config.files import default_config_path, load_config
from hetpipe.core.config.parse import parse_config
from hetpipe.core.config.schema import (
    AllocationConfig,
    CheckpointConfig,
    ClusterConfig,
    DataConfig,
    EmulationConfig,
    FrozenMap,
    GpuRef,
    GpuType,
    ModelConfig,
    NetworkConfig,
    Node,
    PsConfig,
    TrainConfig,
    VirtualWorkerSpec,
    WspConfig,
)
from hetpipe.core.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent

HEAD = 'name = "t"\n'
TYPES = """
[gpu_types.titan-v]
speed = 14.9
memory_gib = 12.0

[gpu_types.rtx-2060]
speed = 6.5
memory_gib = 6.0
"""
NODES = """
[[nodes]]
name = "n0"
gpus = ["titan-v", "titan-v"]

[[nodes]]
name = "n1"
gpus = ["rtx-2060", "rtx-2060"]
"""
MINIMAL = HEAD + TYPES + NODES
LINES = len(MINIMAL.splitlines())


def write(tmp_path: Path, text: str, name: str = "lab.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def load_text(tmp_path: Path, text: str) -> ClusterConfig:
    return load_config(write(tmp_path, text))


# ---------------------------------------------------------------------------------------------- default


def test_default_config_is_packaged_and_linked_from_launch() -> None:
    assert default_config_path() == REPO / "hetpipe" / "clusters" / "local.toml"
    link = REPO / "launch" / "clusters" / "local.toml"
    assert link.is_symlink() and link.resolve() == default_config_path().resolve()


def test_default_config_documents_every_field() -> None:
    """local.toml is the reference for every field: each key of every section appears in it, set or
    commented."""
    from hetpipe.core.config.schema import _GPU_TYPE_KEYS, _NODE_KEYS, _SECTIONS, _TOP_KEYS

    text = default_config_path().read_text()
    missing = [
        f"{section}.{key}"
        for section, keys in _SECTIONS.items()
        for key in keys
        if not re.search(rf"^\s*#?\s*{key}\s*=", text, re.M)
    ]
    missing += [
        key
        for key in (*_TOP_KEYS, *_GPU_TYPE_KEYS, *_NODE_KEYS)
        if key not in _SECTIONS and not re.search(rf"^\s*#?\s*(\[+)?{key}\b", text, re.M)
    ]
    assert not missing, f"hetpipe/clusters/local.toml does not show: {missing}"


def test_default_config_values() -> None:
    cfg = load_config(default_config_path())
    fast, slow = GpuType("fast", 2.0, 8.0), GpuType("slow", 1.0, 4.0)
    assert cfg.name == "local" and cfg.seed == 0
    assert dict(cfg.gpu_types) == {"fast": fast, "slow": slow}
    assert cfg.nodes == (Node("n0", "127.0.0.1", ("fast", "slow")), Node("n1", "127.0.0.1", ("fast", "slow")))
    assert cfg.network == NetworkConfig(100.0, 10.0)
    assert cfg.ps == PsConfig("127.0.0.1", 7400, 1, "balanced", 60.0)
    assert cfg.wsp == WspConfig(staleness=0, nm=2, pull="exact")
    assert cfg.checkpoint == CheckpointConfig("runs/local/ps", every=0, keep=3)
    assert cfg.model == ModelConfig("mnist-cnn", FrozenMap())
    assert cfg.data == DataConfig("mnist", FrozenMap(), 0.2)
    assert cfg.train == TrainConfig(32, 200, "momentum", 0.01, 0.9, 0.0, True, "wsp", out_dir="runs/local")
    assert cfg.emulation == EmulationConfig(enabled=True, time_scale=None, link_bandwidth=False)
    assert cfg.allocation == AllocationConfig("explicit")
    assert cfg.virtual_workers == (
        VirtualWorkerSpec((GpuRef("n0", 0), GpuRef("n0", 1))),
        VirtualWorkerSpec((GpuRef("n1", 0), GpuRef("n1", 1))),
    )
    assert cfg.num_vws == 2
    assert cfg.all_gpus() == [GpuRef("n0", 0), GpuRef("n0", 1), GpuRef("n1", 0), GpuRef("n1", 1)]
    assert cfg.gpu("n1:1") == slow and cfg.gpu(GpuRef("n0", 0)) == fast
    assert cfg.ps_endpoints() == ["tcp://127.0.0.1:7400"]


def test_config_is_immutable_hashable_and_picklable() -> None:
    cfg = load_config(default_config_path())
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    hash(cfg)
    with pytest.raises(AttributeError):
        cfg.wsp.nm = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.gpu_types["x"] = cfg.gpu_types["fast"]  # type: ignore[index]


# ---------------------------------------------------------------------------------------------- round trips


def test_minimal_config_gets_defaults(tmp_path: Path) -> None:
    cfg = load_text(tmp_path, MINIMAL)
    assert cfg.path == tmp_path / "lab.toml"
    assert cfg.seed == 0
    assert cfg.nodes[0] == Node("n0", "127.0.0.1", ("titan-v", "titan-v"))
    assert cfg.network == NetworkConfig()
    assert cfg.ps == PsConfig()
    assert cfg.wsp == WspConfig()
    assert cfg.checkpoint == CheckpointConfig("runs/t/ps", 0, 3)
    assert cfg.model == ModelConfig()
    assert cfg.data == DataConfig()
    assert cfg.train == TrainConfig(out_dir="runs/t")
    assert cfg.emulation == EmulationConfig()
    assert cfg.allocation == AllocationConfig("np")
    assert cfg.virtual_workers == () and cfg.num_vws == 0


ROUND_TRIPS = [
    ("[network]\nintra_node_gbps = 32\ninter_node_gbps = 56.0", "network", NetworkConfig(32.0, 56.0)),
    (
        '[ps]\nhost = "10.0.0.1"\nport = 9000\nshards = 4\nplacement = "balanced"\ntimeout_s = 5',
        "ps",
        PsConfig("10.0.0.1", 9000, 4, "balanced", 5.0),
    ),
    ('[ps]\nauth = "curve"\nkeys_dir = "keys/lab"', "ps", PsConfig(auth="curve", keys_dir="keys/lab")),
    ('[wsp]\nstaleness = 3\nnm = 4\npull = "latest"', "wsp", WspConfig(3, 4, "latest")),
    (
        '[checkpoint]\ndir = ""\nevery = 5\nkeep = 1\nstages = false',
        "checkpoint",
        CheckpointConfig("", 5, 1, False),
    ),
    (
        '[ps]\non_vw_failure = "evict"\nheartbeat_s = 0.5\nhung_after_s = 3\nmax_restarts = 0',
        "ps",
        PsConfig(on_vw_failure="evict", heartbeat_s=0.5, hung_after_s=3.0, max_restarts=0),
    ),
    ('[ps]\nagent = "process"', "ps", PsConfig(agent="process")),
    ("[ps]\nheartbeat_s = 0\nhung_after_s = 0", "ps", PsConfig(heartbeat_s=0.0, hung_after_s=0.0)),
    (
        '[model]\nname = "resnet-18"\noptions = { width = 64, blocks = [2, 2], act = { kind = "relu" } }',
        "model",
        ModelConfig("resnet-18", FrozenMap({"width": 64, "blocks": (2, 2), "act": {"kind": "relu"}})),
    ),
    (
        '[data]\nname = "npy"\ntest_fraction = 0.5\n[data.options]\ndir = "/data"',
        "data",
        DataConfig("npy", FrozenMap({"dir": "/data"}), 0.5),
    ),
    (
        '[train]\nbatch_size = 8\nwaves = 3\noptimizer = "adam"\nlr = 1e-3\nmomentum = 0\n'
        'weight_decay = 1e-4\nweight_stashing = false\nschedule = "gpipe"\nrecompute = true\n'
        'precision = "bf16"\n'
        'eval_every = 5\neval_samples = 0\nout_dir = "/tmp/x"',
        "train",
        TrainConfig(8, 3, "adam", 1e-3, 0.0, 1e-4, False, "gpipe", True, "bf16", 5, 0, "/tmp/x"),
    ),
    (
        '[emulation]\nenabled = false\ntime_scale = 2\nlink_bandwidth = true\ndevice = "cuda"',
        "emulation",
        EmulationConfig(False, 2.0, True, "cuda"),
    ),
    (
        '[ps]\naggregation = "server"\nbuffers = "local"',
        "ps",
        PsConfig(aggregation="server", buffers="local"),
    ),
    ('[train]\non_nan = "skip"', "train", TrainConfig(out_dir="runs/t", on_nan="skip")),
    ('[emulation]\ntime_scale = "auto"', "emulation", EmulationConfig(True, None, False)),
    ('[allocation]\npolicy = "hd"', "allocation", AllocationConfig("hd")),
    (
        '[[virtual_workers]]\ngpus = ["n0:1", "n1:0"]\nlayers = [4, 3]\n[[virtual_workers]]\ngpus = ["n0:0"]',
        "virtual_workers",
        (
            VirtualWorkerSpec((GpuRef("n0", 1), GpuRef("n1", 0)), (4, 3)),
            VirtualWorkerSpec((GpuRef("n0", 0),)),
        ),
    ),
]


@pytest.mark.parametrize(("text", "attr", "expected"), ROUND_TRIPS, ids=[r[1] for r in ROUND_TRIPS])
def test_section_round_trip(tmp_path: Path, text: str, attr: str, expected: object) -> None:
    assert getattr(load_text(tmp_path, MINIMAL + text), attr) == expected


def test_top_level_and_types_round_trip(tmp_path: Path) -> None:
    cfg = load_text(tmp_path, 'name = "lab-4x4"\nseed = 7\n' + TYPES.replace("14.9", "15") + NODES)
    assert (cfg.name, cfg.seed) == ("lab-4x4", 7)
    speed = cfg.gpu_types["titan-v"].speed
    assert speed == 15.0 and isinstance(speed, float)  # an int is accepted for a float
    assert list(cfg.gpu_types) == ["titan-v", "rtx-2060"]  # file order


def test_checkpoint_dir_follows_out_dir(tmp_path: Path) -> None:
    cfg = load_text(tmp_path, MINIMAL + '[train]\nout_dir = "runs/exp3/"')
    assert cfg.checkpoint.dir == "runs/exp3/ps" and cfg.checkpoint.enabled
    assert not load_text(tmp_path, MINIMAL + '[checkpoint]\ndir = ""').checkpoint.enabled


def test_options_are_frozen_and_thaw_to_plain_data(tmp_path: Path) -> None:
    cfg = load_text(tmp_path, MINIMAL + "[model.options]\nsizes = [1, [2, 3]]\nsub = { a = 1 }")
    options = cfg.model.options
    assert options["sizes"] == (1, (2, 3)) and isinstance(options["sub"], FrozenMap)
    assert options.to_dict() == {"sizes": [1, [2, 3]], "sub": {"a": 1}}
    assert hash(options) == hash(FrozenMap({"sub": {"a": 1}, "sizes": [1, [2, 3]]}))


def test_parse_config_is_pure() -> None:
    data = {
        "name": "x",
        "gpu_types": {"g": {"speed": 1, "memory_gib": 2}},
        "nodes": [{"name": "a", "gpus": ["g"]}],
    }
    cfg = parse_config(data, Path("mem.toml"))
    assert cfg.path == Path("mem.toml") and cfg.all_gpus() == [GpuRef("a", 0)]


def test_ps_endpoints_one_port_per_shard(tmp_path: Path) -> None:
    cfg = load_text(tmp_path, MINIMAL + '[ps]\nhost = "10.0.0.2"\nport = 65533\nshards = 3')
    assert cfg.ps_endpoints() == ["tcp://10.0.0.2:65533", "tcp://10.0.0.2:65534", "tcp://10.0.0.2:65535"]


@pytest.mark.parametrize("placement", ["local", "spread"])
def test_per_node_placements_put_shard_i_on_node_i(tmp_path: Path, placement: str) -> None:
    text = MINIMAL.replace('name = "n0"', 'name = "n0"\nhost = "10.0.0.5"').replace(
        'name = "n1"', 'name = "n1"\nhost = "10.0.0.6"'
    )
    ps = f'[ps]\nhost = "10.0.0.2"\nport = 9000\nshards = 2\nplacement = "{placement}"'
    cfg = load_text(tmp_path, text + ps)
    assert cfg.ps_endpoints() == ["tcp://10.0.0.5:9000", "tcp://10.0.0.6:9001"]
    assert [cfg.shard_host(i) for i in (0, 1)] == ["10.0.0.5", "10.0.0.6"]


def test_gpu_ref_parse_and_str() -> None:
    assert GpuRef.parse("n0:12") == GpuRef("n0", 12) and str(GpuRef("n0", 12)) == "n0:12"
    for bad in ["n0", "n0:", ":1", "n0:-1", "n0:1:2", "n 0:1"]:
        with pytest.raises(ValueError, match="node-name:gpu-index"):
            GpuRef.parse(bad)


# ---------------------------------------------------------------------------------------------- errors

# (id, file text, substrings the message must contain: field path + what is wrong, and the fix)
ERRORS = [
    # syntax
    (
        "toml-syntax",
        MINIMAL + "[wsp]\nstaleness = = 2\n",
        [
            "invalid TOML",
            f"line {LINES + 2}, column",
            f"line {LINES + 2} reads `staleness = = 2`",
            "fix its syntax",
        ],
    ),
    # unknown keys
    (
        "unknown-top-key",
        HEAD + "sed = 1\n" + TYPES + NODES,
        ["sed: unknown key", "allowed keys at the top of the file: name, seed", '(did you mean "seed"?)'],
    ),
    ("unknown-section", MINIMAL + "[trian]\nlr = 1\n", ["trian: unknown key", '(did you mean "train"?)']),
    (
        "misplaced-key",
        HEAD + "staleness = 1\n" + TYPES + NODES,
        ["staleness: unknown key", "(`staleness` belongs under [wsp])"],
    ),
    (
        "unknown-section-key",
        MINIMAL + "[wsp]\nstalenes = 1\n",
        [
            "wsp.stalenes: unknown key",
            "allowed keys under [wsp]: staleness, nm, pull",
            'did you mean "staleness"',
        ],
    ),
    (
        "unknown-key-no-match",
        MINIMAL + "[ps]\nzzz = 1\n",
        ["ps.zzz: unknown key", "allowed keys under [ps]: host, port, shards, placement, timeout_s"],
    ),
    (
        "unknown-gpu-type-key",
        MINIMAL.replace("memory_gib = 6.0", "memory_gb = 6.0"),
        ["gpu_types.rtx-2060.memory_gb: unknown key", 'did you mean "memory_gib"'],
    ),
    (
        "unknown-node-key",
        MINIMAL + '[[nodes]]\nname = "n2"\ngpus = ["titan-v"]\ngpu = 1\n',
        ["nodes[2].gpu: unknown key", "allowed keys in the 3rd [[nodes]] table", 'did you mean "gpus"'],
    ),
    (
        "unknown-vw-key",
        MINIMAL + '[[virtual_workers]]\ngpus = ["n0:0"]\nlayer = [1]\n',
        ["virtual_workers[0].layer: unknown key", 'did you mean "layers"'],
    ),
    ("quoted-unknown-key", MINIMAL + '[wsp]\n"odd key" = 1\n', ['wsp."odd key": unknown key']),
    # missing required fields
    ("missing-name", TYPES + NODES, ["name: required field is missing", 'add `name = "<str>"` at the top']),
    (
        "missing-gpu-types",
        HEAD + NODES,
        ["gpu_types: required section is missing", "declare at least one GPU type, e.g. [gpu_types.titan-v]"],
    ),
    (
        "empty-gpu-types",
        HEAD + "gpu_types = {}\n" + NODES,
        ["gpu_types: no GPU types declared", "declare at least one GPU type"],
    ),
    (
        "missing-speed",
        MINIMAL.replace("speed = 6.5\n", ""),
        [
            "gpu_types.rtx-2060.speed: required field is missing",
            "add `speed = <float > 0>` under [gpu_types.rtx-2060]",
        ],
    ),
    (
        "missing-nodes",
        HEAD + TYPES,
        ["nodes: required section is missing", 'add at least one [[nodes]] table with name = "n0"'],
    ),
    (
        "missing-node-name",
        MINIMAL + '[[nodes]]\ngpus = ["titan-v"]\n',
        ["nodes[2].name: required field is missing", 'add `name = "<str>"` in the 3rd [[nodes]] table'],
    ),
    (
        "missing-node-gpus",
        MINIMAL + '[[nodes]]\nname = "n2"\n',
        [
            "nodes[2].gpus: required field is missing",
            'add `gpus = ["titan-v", ...]` in the 3rd [[nodes]] table',
        ],
    ),
    (
        "missing-vw-gpus",
        MINIMAL + "[[virtual_workers]]\nlayers = [1]\n",
        ["virtual_workers[0].gpus: required field is missing", "add `gpus = "],
    ),
    # wrong types
    (
        "bool-is-not-int",
        MINIMAL + "[wsp]\nnm = true\n",
        ["wsp.nm: expected an integer, got true (a boolean)", "write `nm = <int >= 1>` under [wsp]"],
    ),
    (
        "float-is-not-int",
        MINIMAL + "[wsp]\nstaleness = 1.5\n",
        [
            "wsp.staleness: expected an integer, got 1.5 (a float)",
            "write `staleness = <int >= 0>` under [wsp]",
        ],
    ),
    (
        "string-is-not-float",
        MINIMAL + '[train]\nlr = "0.1"\n',
        ['train.lr: expected a number, got "0.1" (a string)', "write `lr = <float > 0>` under [train]"],
    ),
    (
        "bool-is-not-float",
        MINIMAL + "[network]\ninter_node_gbps = true\n",
        ["network.inter_node_gbps: expected a number, got true (a boolean)"],
    ),
    (
        "int-is-not-bool",
        MINIMAL + "[train]\nweight_stashing = 1\n",
        [
            "train.weight_stashing: expected a boolean, got 1 (an integer)",
            "write `weight_stashing = true or false`",
        ],
    ),
    (
        "int-is-not-string",
        HEAD.replace('"t"', "5") + TYPES + NODES,
        ["name: expected a string, got 5 (an integer)", 'write `name = "<str>"`'],
    ),
    (
        "section-not-table",
        MINIMAL.replace(HEAD, HEAD + "wsp = 3\n"),
        ["wsp: expected a table, got 3 (an integer)", "write it as a [wsp] section"],
    ),
    (
        "nodes-not-array",
        HEAD + TYPES + '[nodes]\nname = "n0"\n',
        [
            "nodes: expected an array of tables, got a table",
            "write each entry as a [[nodes]] table (double brackets)",
        ],
    ),
    (
        "gpus-not-array",
        MINIMAL.replace('gpus = ["rtx-2060", "rtx-2060"]', 'gpus = "rtx-2060"'),
        ['nodes[1].gpus: expected an array of strings, got "rtx-2060" (a string)'],
    ),
    (
        "gpus-item-not-string",
        MINIMAL.replace('gpus = ["rtx-2060", "rtx-2060"]', 'gpus = ["rtx-2060", 2]'),
        ["nodes[1].gpus[1]: expected a string, got 2 (an integer)", "(strings need quotes)"],
    ),
    (
        "options-not-table",
        MINIMAL + '[model]\noptions = "wide"\n',
        ['model.options: expected a table, got "wide" (a string)'],
    ),
    (
        "layers-item-not-int",
        MINIMAL + '[[virtual_workers]]\ngpus = ["n0:0"]\nlayers = [1.5]\n',
        ["virtual_workers[0].layers[0]: expected an integer, got 1.5 (a float)"],
    ),
    (
        "time-scale-type",
        MINIMAL + "[emulation]\ntime_scale = true\n",
        [
            'emulation.time_scale: expected "auto" or a number, got true',
            'write `time_scale = "auto" or <float > 0>`',
        ],
    ),
    # out of range
    (
        "negative-staleness",
        MINIMAL + "[wsp]\nstaleness = -1\n",
        ["wsp.staleness: must be >= 0, got -1", "set `staleness` under [wsp] to an integer >= 0"],
    ),
    ("zero-nm", MINIMAL + "[wsp]\nnm = 0\n", ["wsp.nm: must be >= 1, got 0"]),
    (
        "zero-speed",
        MINIMAL.replace("speed = 6.5", "speed = 0"),
        [
            "gpu_types.rtx-2060.speed: must be > 0, got 0",
            "set `speed` under [gpu_types.rtx-2060] to a number > 0",
        ],
    ),
    (
        "nan-memory",
        MINIMAL.replace("memory_gib = 6.0", "memory_gib = nan"),
        ["gpu_types.rtx-2060.memory_gib: must be a finite number, got nan"],
    ),
    (
        "test-fraction",
        MINIMAL + "[data]\ntest_fraction = 1.0\n",
        ["data.test_fraction: must be in (0, 1), got 1.0"],
    ),
    ("momentum-one", MINIMAL + "[train]\nmomentum = 1\n", ["train.momentum: must be in [0, 1), got 1"]),
    ("low-port", MINIMAL + "[ps]\nport = 80\n", ["ps.port: must be in [1024, 65535], got 80"]),
    (
        "port-plus-shards",
        MINIMAL + "[ps]\nport = 65534\nshards = 3\n",
        [
            "ps.port: 3 shards from port 65534 need ports up to 65536, above 65535",
            "set port to at most 65533, or use fewer shards",
        ],
    ),
    ("negative-seed", HEAD + "seed = -3\n" + TYPES + NODES, ["seed: must be in [0, 4294967295], got -3"]),
    ("keep-zero", MINIMAL + "[checkpoint]\nkeep = 0\n", ["checkpoint.keep: must be >= 1, got 0"]),
    (
        "time-scale-zero",
        MINIMAL + "[emulation]\ntime_scale = 0\n",
        ["emulation.time_scale: must be > 0, got 0"],
    ),
    (
        "layers-zero",
        MINIMAL + '[[virtual_workers]]\ngpus = ["n0:0"]\nlayers = [0]\n',
        ["virtual_workers[0].layers[0]: must be >= 1, got 0"],
    ),
    (
        "empty-node-gpus",
        MINIMAL.replace('gpus = ["rtx-2060", "rtx-2060"]', "gpus = []"),
        ["nodes[1].gpus: must not be empty", 'write `gpus = ["titan-v", ...]` in the 2nd [[nodes]] table'],
    ),
    (
        "empty-host",
        MINIMAL.replace('name = "n1"', 'name = "n1"\nhost = ""'),
        ["nodes[1].host: must not be empty"],
    ),
    # enums
    (
        "bad-pull",
        MINIMAL + '[wsp]\npull = "exactt"\n',
        ['wsp.pull: unknown value "exactt"', 'choose one of: exact, latest (did you mean "exact"?)'],
    ),
    (
        "bad-optimizer",
        MINIMAL + '[train]\noptimizer = "adamw"\n',
        [
            'train.optimizer: unknown value "adamw"',
            "choose one of: sgd, momentum, adam",
            'did you mean "adam"',
        ],
    ),
    (
        "bad-policy",
        MINIMAL + '[allocation]\npolicy = "HD"\n',
        ['allocation.policy: unknown value "HD"', 'np, ed, hd, dp (did you mean "hd"?)'],
    ),
    (
        "bad-placement",
        MINIMAL + '[ps]\nplacement = "scatter"\n',
        ['ps.placement: unknown value "scatter"', "balanced, local, spread"],
    ),
    (
        "local-placement-shards",
        MINIMAL + '[ps]\nplacement = "local"\n',
        [
            'ps.shards: is 1 but placement = "local" runs one shard on each of the 2 nodes',
            'set shards = 2, or placement = "balanced"',
        ],
    ),
    (
        "spread-placement-shards",
        MINIMAL + '[ps]\nplacement = "spread"\nshards = 3\n',
        [
            'ps.shards: is 3 but placement = "spread" runs one shard on each of the 2 nodes',
            'set shards = 2, or placement = "balanced"',
        ],
    ),
    (
        "bad-auth",
        MINIMAL + '[ps]\nauth = "curv"\n',
        ['ps.auth: unknown value "curv"', 'choose one of: none, curve (did you mean "curve"?)'],
    ),
    (
        "auth-not-string",
        MINIMAL + "[ps]\nauth = true\n",
        ["ps.auth: expected a string, got true (a boolean)", 'write `auth = "none" | "curve"` under [ps]'],
    ),
    (
        "keys-dir-not-string",
        MINIMAL + "[ps]\nkeys_dir = 3\n",
        ["ps.keys_dir: expected a string, got 3 (an integer)", 'write `keys_dir = "<str>"` under [ps]'],
    ),
    (
        "unknown-ps-key-near-auth",
        MINIMAL + '[ps]\nauthentication = "curve"\n',
        ["ps.authentication: unknown key", "buffers, auth, keys_dir"],
    ),
    (
        "bad-on-nan",
        MINIMAL + '[train]\non_nan = "skipp"\n',
        ['train.on_nan: unknown value "skipp"', 'choose one of: stop, skip (did you mean "skip"?)'],
    ),
    (
        "misplaced-on-nan",
        MINIMAL + '[wsp]\non_nan = "skip"\n',
        ["wsp.on_nan: unknown key", "(`on_nan` belongs under [train])"],
    ),
    (
        "bad-on-vw-failure",
        MINIMAL + '[ps]\non_vw_failure = "evicted"\n',
        ['ps.on_vw_failure: unknown value "evicted"', 'choose one of: stop, evict (did you mean "evict"?)'],
    ),
    (
        "bad-ps-agent",
        MINIMAL + '[ps]\nagent = "processes"\n',
        [
            'ps.agent: unknown value "processes"',
            'choose one of: auto, thread, process (did you mean "process"?)',
        ],
    ),
    (
        "misplaced-on-vw-failure",
        MINIMAL + '[train]\non_vw_failure = "evict"\n',
        ["train.on_vw_failure: unknown key", "(`on_vw_failure` belongs under [ps])"],
    ),
    (
        "hung-before-a-heartbeat",
        MINIMAL + "[ps]\nheartbeat_s = 5\nhung_after_s = 6\n",
        ["ps.hung_after_s: 6 s with heartbeat_s = 5", "at least twice heartbeat_s (or 0 to never"],
    ),
    (
        "hung-without-heartbeats",
        MINIMAL + "[ps]\nheartbeat_s = 0\n",
        ["ps.hung_after_s: 60 s with heartbeat_s = 0"],
    ),
    ("negative-restarts", MINIMAL + "[ps]\nmax_restarts = -1\n", ["ps.max_restarts: must be >= 0, got -1"]),
    (
        "stages-not-bool",
        MINIMAL + '[checkpoint]\nstages = "yes"\n',
        ['checkpoint.stages: expected a boolean, got "yes"'],
    ),
    (
        "bad-time-scale",
        MINIMAL + '[emulation]\ntime_scale = "atuo"\n',
        ['emulation.time_scale: unknown value "atuo"', 'write time_scale = "auto" or a number > 0'],
    ),
    # names
    (
        "bad-run-name",
        'name = "my run"\n' + TYPES + NODES,
        ['name: invalid name "my run"', "use only letters, digits, '-' and '_'"],
    ),
    ("bad-node-name", MINIMAL.replace('name = "n1"', 'name = "n:1"'), ['nodes[1].name: invalid name "n:1"']),
    (
        "bad-type-name",
        MINIMAL + "[gpu_types.'a b']\nspeed = 1\nmemory_gib = 1\n",
        ['gpu_types."a b": invalid GPU type name "a b"', "use only letters"],
    ),
    (
        "duplicate-node",
        MINIMAL.replace('name = "n1"', 'name = "n0"'),
        ['nodes[1].name: duplicate node name "n0" (also nodes[0].name)', "give each node a unique name"],
    ),
    (
        "unknown-gpu-type",
        MINIMAL.replace('gpus = ["rtx-2060", "rtx-2060"]', 'gpus = ["rtx-2060", "rtx2060"]'),
        [
            'nodes[1].gpus[1]: unknown GPU type "rtx2060"',
            'known types: titan-v, rtx-2060 (did you mean "rtx-2060"?)',
        ],
    ),
    # virtual workers
    (
        "bad-gpu-ref",
        MINIMAL + '[[virtual_workers]]\ngpus = ["n0-1"]\n',
        [
            'virtual_workers[0].gpus[0]: "n0-1" is not a GPU reference',
            'write "node-name:gpu-index", e.g. "n0:1"',
        ],
    ),
    (
        "unknown-node-ref",
        MINIMAL + '[[virtual_workers]]\ngpus = ["n0:0"]\n[[virtual_workers]]\ngpus = ["nd1:0"]\n',
        [
            'virtual_workers[1].gpus[0]: unknown node "nd1" in "nd1:0"',
            'known nodes: n0, n1 (did you mean "n1"?)',
        ],
    ),
    (
        "gpu-index-out-of-range",
        MINIMAL + '[[virtual_workers]]\ngpus = ["n1:2"]\n',
        ['virtual_workers[0].gpus[0]: node "n1" has no GPU 2', 'node "n1" has 2 GPUs: use index 0..1'],
    ),
    (
        "gpu-in-two-vws",
        MINIMAL + '[[virtual_workers]]\ngpus = ["n0:0", "n1:0"]\n'
        '[[virtual_workers]]\ngpus = ["n0:1", "n1:0"]\n',
        [
            'virtual_workers[1].gpus[1]: GPU "n1:0" is already in virtual_workers[0]',
            "a GPU can belong to only one virtual worker",
        ],
    ),
    (
        "gpu-twice-in-vw",
        MINIMAL + '[[virtual_workers]]\ngpus = ["n0:0", "n0:0"]\n',
        ['virtual_workers[0].gpus[1]: GPU "n0:0" appears twice in this virtual worker', "list each GPU once"],
    ),
    (
        "layers-length",
        MINIMAL + '[[virtual_workers]]\ngpus = ["n0:0", "n1:0"]\nlayers = [4, 3, 1]\n',
        ["virtual_workers[0].layers: has 3 entries but gpus has 2", "give one layer count per GPU"],
    ),
    (
        "explicit-without-vws",
        MINIMAL + '[allocation]\npolicy = "explicit"\n',
        [
            'allocation.policy: is "explicit" but no [[virtual_workers]] are listed',
            "add [[virtual_workers]] tables",
        ],
    ),
    (
        "vws-with-other-policy",
        MINIMAL + '[allocation]\npolicy = "ed"\n[[virtual_workers]]\ngpus = ["n0:0"]\n',
        ['virtual_workers: listed, but allocation.policy = "ed" builds its own', 'set policy = "explicit"'],
    ),
    (
        "vw-not-table",
        HEAD + 'virtual_workers = ["n0:0"]\n' + TYPES + NODES,
        [
            'virtual_workers[0]: expected a table, got "n0:0" (a string)',
            "write each entry as a [[virtual_workers]]",
        ],
    ),
]


@pytest.mark.parametrize(("text", "fragments"), [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_error_names_file_field_and_fix(tmp_path: Path, text: str, fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_text(tmp_path, text)
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'lab.toml'}: ")
    assert len(message.splitlines()) == 2 and message.splitlines()[1].startswith("  ")  # what, then the fix
    for fragment in fragments:
        assert fragment in message
    assert info.value.exit_code == 2


def test_missing_file_lists_configs_nearby(tmp_path: Path) -> None:
    write(tmp_path, MINIMAL, "lab.toml")
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "lba.toml")
    message = str(info.value)
    assert f"{tmp_path / 'lba.toml'}: no such config file" in message
    assert f"configs in {tmp_path}: lab.toml" in message and 'did you mean "lab.toml"' in message


def test_missing_file_in_missing_folder_points_at_default(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such config file\n  check the path; the packaged default"):
        load_config(tmp_path / "nowhere" / "lab.toml")


def test_directory_and_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)
    path = tmp_path / "bad.toml"
    path.write_bytes(b"name = \xff\n")
    with pytest.raises(ConfigError, match="not UTF-8 text.*\n  save the file as UTF-8"):
        load_config(path)


def test_unreadable_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, MINIMAL)

    def deny(self: Path) -> bytes:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", deny)
    with pytest.raises(
        ConfigError, match="cannot read: Permission denied\n  check that the file is readable"
    ):
        load_config(path)


# --------------------------------------------------------------------------------------- dict form, --set

SHIPPED = sorted((REPO / "launch" / "clusters").glob("*.toml")) + [default_config_path()]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_dict_form_round_trips_every_shipped_config(path: Path) -> None:
    from hetpipe.core.config.serialize import pack_config, unpack_config

    config = load_config(path)
    assert parse_config(config.to_dict(), path) == config
    assert unpack_config(pack_config(config)) == config  # what a child process receives


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_toml_form_loads_back_to_the_same_config(path: Path, tmp_path: Path) -> None:
    """config_toml is what the testbed's `hetpipe server`/`worker` read: it must load to the same config."""
    from dataclasses import replace

    from hetpipe.core.config.overrides import apply_overrides
    from hetpipe.core.config.serialize import config_toml

    config = apply_overrides(
        load_config(path), ['data.options={ block_size = 8, note = "a \\"quoted\\" text" }']
    )
    written = tmp_path / "effective.toml"
    written.write_text(config_toml(config))
    assert load_config(written) == replace(config, path=written)


def test_set_overrides_are_typed_and_validated(tmp_path: Path) -> None:
    from hetpipe.core.config.overrides import apply_overrides

    base = load_config(write(tmp_path, MINIMAL + '[model]\nname = "mlp"\noptions = { hidden = [8] }\n'))
    config = apply_overrides(
        base,
        [
            "wsp.nm=4",
            "wsp.pull=latest",
            "train.lr=1e-3",
            "model.options.hidden=[64, 64]",
            "emulation.enabled=false",
            'train.out_dir="runs/x y"',
        ],
    )
    assert (config.wsp.nm, config.wsp.pull, config.train.lr) == (4, "latest", 0.001)
    assert config.model.options["hidden"] == (64, 64) and config.emulation.enabled is False
    assert config.train.out_dir == "runs/x y" and config.wsp.staleness == base.wsp.staleness
    assert apply_overrides(base, []) is base


@pytest.mark.parametrize(
    ("setting", "fragments"),
    [
        ("wsp.nm=0", ["lab.toml with --set wsp.nm=0", "wsp.nm: must be >= 1, got 0"]),
        ("wsp.nmm=2", ["wsp.nmm: unknown key", 'did you mean "nm"']),
        ("wsp.nm=four", ['wsp.nm: expected an integer, got "four" (a string)']),
        ("wsp.pull=lates", ['wsp.pull: unknown value "lates"', 'did you mean "latest"']),
        ("trian.lr=0.1", ["trian: unknown key", 'did you mean "train"']),
        ("nodes.5.host=x", ["--set 'nodes.5.host=x': nodes has 2 entries; index them 0..1"]),
        ("wsp.nm", ["--set 'wsp.nm': write KEY.PATH=VALUE"]),
        ("name.x=1", ["--set 'name.x=1': name is a value, not a table"]),
    ],
)
def test_set_errors_name_the_key_and_the_fix(tmp_path: Path, setting: str, fragments: list[str]) -> None:
    from hetpipe.core.config.overrides import apply_overrides

    base = load_config(write(tmp_path, MINIMAL))
    with pytest.raises(ConfigError) as info:
        apply_overrides(base, [setting])
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        (
            '[train]\nschedule = "gpipee"',
            ['train.schedule: unknown value "gpipee"', "1f1b-flush", 'did you mean "gpipe"'],
        ),
        (
            '[train]\nschedule = "pipedream-2bw"\nweight_stashing = false',
            ["train.weight_stashing: is false", "two weight versions", 'choose schedule = "wsp"'],
        ),
        ("[train]\nrecompute = true", ['train.recompute: is true, but schedule "wsp"', "1f1b-flush, gpipe"]),
        ('[ps]\naggregation = "avg"', ['ps.aggregation: unknown value "avg"', "sum, mean, server"]),
        ('[ps]\nbuffers = "sum"', ['ps.buffers: unknown value "sum"', "average, local"]),
        ('[train]\nprecision = "fp16"', ['train.precision: unknown value "fp16"', "fp32, bf16"]),
    ],
)
def test_schedule_and_semantics_errors_at_load(tmp_path: Path, text: str, fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, MINIMAL + text))
    for fragment in fragments:
        assert fragment in str(info.value)


def test_node_devices_override_and_errors(tmp_path: Path) -> None:
    nodes = NODES.replace(
        'gpus = ["titan-v", "titan-v"]', 'gpus = ["titan-v", "titan-v"]\ndevices = ["cuda:0", "cpu"]'
    )
    cfg = load_config(write(tmp_path, HEAD + TYPES + nodes))
    assert cfg.nodes[0].devices == ("cuda:0", "cpu") and cfg.nodes[1].devices is None
    for devices, fragment in (
        ('["cuda:0"]', "has 1 entries but gpus has 2"),
        ('["gpu0", "cpu"]', 'unknown device "gpu0"'),
    ):
        bad = NODES.replace(
            'gpus = ["titan-v", "titan-v"]', f'gpus = ["titan-v", "titan-v"]\ndevices = {devices}'
        )
        with pytest.raises(ConfigError, match=fragment):
            load_config(write(tmp_path, HEAD + TYPES + bad))
