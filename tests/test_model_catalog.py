"""The model catalog (hetpipe/app/model_catalog.py): what it says of each model matches the model built, it
lists every shipped config's model, and planning a real cluster with it needs no torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hetpipe.app.model_catalog import CATALOG, ModelKey, key_of, model_key, options_text
from hetpipe.app.plan_inputs import plan_profiles, shipped_profile
from hetpipe.compute.profiler import options_digest, profile_cache_path, profile_dtype
from hetpipe.core.config.files import load_config
from hetpipe.core.planning.profile import derive_profile
from hetpipe.models import MODELS, get_model

ROOT = Path(__file__).resolve().parents[1]
PAPER = ROOT / "launch" / "clusters" / "paper-16gpu.toml"
CONFIGS = sorted((ROOT / "launch" / "clusters").glob("*.toml")) + sorted(
    (ROOT / "hetpipe" / "clusters").glob("*.toml")
)
ENTRIES = [
    (name, variant) for name, variants in json.loads(CATALOG.read_text()).items() for variant in variants
]


@pytest.mark.parametrize(("name", "variant"), ENTRIES, ids=[f"{n}{v}" for n, v in ENTRIES])
def test_every_catalog_entry_is_what_the_model_built_says(name: str, variant: str) -> None:
    for options in (json.loads(variant), {**json.loads(variant), "seed": 3}):
        spec = get_model(name, **options)
        built = ModelKey(spec.name, options_digest(spec), profile_dtype(spec, None), spec.num_layers)
        assert model_key(name, options) == built, "run launch/ship_profiles.py --catalog"


def test_the_catalog_lists_every_built_in_model_and_every_shipped_configs_model() -> None:
    listed = {(name, variant) for name, variant in ENTRIES}
    assert {name for name, _ in listed} == set(MODELS)
    for path in CONFIGS:
        model = load_config(path).model
        if model.name in MODELS:
            assert (model.name, options_text(model.options.to_dict())) in listed, (
                f"{path.name}: run launch/ship_profiles.py --catalog"
            )


def test_a_variant_the_catalog_lacks_is_built(tmp_path: Path) -> None:
    options = {"width": 8, "image_size": 32}
    assert options_text(options) not in json.loads(CATALOG.read_text())["resnet18"]
    assert model_key("resnet18", options) == key_of(get_model("resnet18", **options))
    # a missing or broken catalog file only costs the build
    (tmp_path / "models.json").write_text("{not json")
    assert model_key("resnet152", {}, tmp_path / "models.json") == key_of(get_model("resnet152"))


def test_plan_reads_a_profile_under_its_cache_name_before_the_shipped_one(tmp_path: Path) -> None:
    config = load_config(PAPER)
    batch, optimizer = config.train.batch_size, config.train.optimizer
    spec = get_model(config.model.name)
    _, shipped = shipped_profile(key_of(spec), batch, optimizer=optimizer)
    mine = derive_profile(shipped, 7.0, 1.0, 1.0, gpu_type="titan-v")
    mine.save(profile_cache_path(spec, batch, "titan-v", tmp_path, optimizer=optimizer))
    profiles, *_ = plan_profiles(config, tmp_path)
    assert profiles["titan-v"].layers == mine.layers and profiles["titan-v"].layers != shipped.layers


def test_planning_a_real_cluster_of_a_built_in_model_imports_no_torch(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from hetpipe.cli import main\n"
        f"try:\n    main(['plan', {str(PAPER)!r}, '--profile-dir', {str(tmp_path)!r}, '-D', '0', "
        "'--policy', 'ed', '--schedule', 'wsp'])\n"
        "except SystemExit as exc:\n    assert not exc.code, exc.code\n"
        "print('torch imported' if 'torch' in sys.modules else 'no torch')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "no torch"
