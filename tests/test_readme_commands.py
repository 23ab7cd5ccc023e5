"""Every command the README shows runs as written: each ```bash block of README.md, run on this checkout.

How a block runs:
- as one bash script under `set -euo pipefail`, its lines as the README has them, so a failing command fails
  the test and names the block;
- with the checkout's `.venv/bin` first on PATH (where `launch/setup.sh` puts `hetpipe`), except a block that
  activates the environment itself (`source .venv/bin/activate`): that one must put `hetpipe` on PATH alone,
  as its README text says it does;
- in a fresh temporary directory holding a symlink to each top-level entry of the checkout, so the README's
  relative paths (`launch/...`, `examples/...`, `.venv`) resolve and what a command writes (a copied config,
  a plan, `runs/`) stays out of the checkout; a block that calls `bash launch/...` runs in the checkout
  itself, since those scripts move there anyway (and must never set up a second environment elsewhere);
- with `$README_TMP` set to a temporary directory, for run directories.

Shortened runs: an HTML comment after a block, invisible on the rendered page,

    <!-- test: PREFIX += ARGS -->

appends ARGS (before any trailing `# comment`) to the block's one line that starts with PREFIX, e.g.
`<!-- test: hetpipe train my-cluster.toml += --set train.waves=4 -->` trains 4 waves instead of the config's
200. A comment whose PREFIX starts no line, or several, of the block above it fails the test.

Left out, on purpose (each must still be in the README, which the test checks):
- `bash launch/test.sh`: the whole suite, which this test is part of; CI runs it itself (.ci/run).
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
VENV_BIN = ROOT / ".venv" / "bin"
ACTIVATES = "source .venv/bin/activate"
# line of the README -> why the test does not run it
LEFT_OUT = {"bash launch/test.sh": "the whole suite, which this test is part of; CI runs it itself (.ci/run)"}
DIRECTIVE = re.compile(r"^<!--\s*test:\s*(.+?)\s+\+=\s+(.+?)\s*-->$")
FENCE = re.compile(r"^(```|~~~)(\w*)\s*$")
BLOCK_TIMEOUT_S = 110


@dataclass
class Block:
    """One ```bash block of the README: where it starts, its lines, and the test's additions."""

    line: int
    lines: list[str]
    appends: list[tuple[str, str]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"README.md:{self.line}"


def blocks(text: str) -> list[Block]:
    """The ```bash blocks of a Markdown text, each with the `<!-- test: ... -->` comments that follow it."""
    found: list[Block] = []
    fence: str | None = None
    current: Block | None = None
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if fence is not None:
            if match and match[1] == fence and not match[2]:
                fence, current = None, None
            elif current is not None:
                current.lines.append(line)
            continue
        if match:
            fence = match[1]
            if match[2] == "bash":
                current = Block(number + 1, [])
                found.append(current)
            continue
        directive = DIRECTIVE.match(line.strip())
        if directive:
            assert found, f"README.md:{number}: a test comment before any bash block"
            found[-1].appends.append((directive[1], directive[2]))
    return found


def comment_start(line: str) -> int:
    """Where a bash line's trailing comment starts (`#` after a blank, outside quotes); len(line) if none."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return i
    return len(line)


def script(block: Block) -> tuple[str, list[str]]:
    """The bash script the test runs for a block, and the left-out lines it dropped."""
    lines = list(block.lines)
    for prefix, args in block.appends:
        at = [i for i, line in enumerate(lines) if line.startswith(prefix)]
        assert len(at) == 1, f"{block.name}: `test: {prefix} += ...` matches {len(at)} lines of the block"
        line = lines[at[0]]
        cut = comment_start(line)
        lines[at[0]] = f"{line[:cut].rstrip()} {args}  {line[cut:]}".rstrip()
    dropped = [line for line in lines if code(line) in LEFT_OUT]
    kept = [line for line in lines if code(line) not in LEFT_OUT]
    return "set -euo pipefail\n" + "\n".join(kept) + "\n", [code(line) for line in dropped]


def code(line: str) -> str:
    """A line without its trailing comment and surrounding blanks."""
    return line[: comment_start(line)].strip()


def environment(block: Block, tmp: Path) -> dict[str, str]:
    """The block's environment: the venv's bin first on PATH unless the block activates it itself."""
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and Path(p) != VENV_BIN]
    if not any(code(line) == ACTIVATES for line in block.lines):
        path.insert(0, str(VENV_BIN))
    env["PATH"] = os.pathsep.join(path)
    env["README_TMP"] = str(tmp)
    return env


def workdir(block: Block, tmp: Path) -> Path:
    """The checkout for a block that calls `bash launch/...`, else a temp dir mirroring the checkout."""
    if any(code(line).startswith("bash launch/") for line in block.lines):
        return ROOT
    mirror = tmp / "work"
    mirror.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in {".git", "runs"}:
            (mirror / entry.name).symlink_to(entry)
    return mirror


README_BLOCKS = blocks(README.read_text())


def test_the_readme_has_command_blocks_and_the_left_out_lines() -> None:
    assert README_BLOCKS, "README.md has no ```bash block"
    lines = {code(line) for block in README_BLOCKS for line in block.lines}
    assert set(LEFT_OUT) <= lines, f"README.md no longer shows {sorted(set(LEFT_OUT) - lines)}"


@pytest.mark.slow
@pytest.mark.timeout(BLOCK_TIMEOUT_S + 10)
@pytest.mark.parametrize("block", README_BLOCKS, ids=lambda block: block.name)
def test_the_readme_command_block_runs(block: Block, tmp_path: Path) -> None:
    assert (VENV_BIN / "hetpipe").exists(), "no .venv/bin/hetpipe: run `bash launch/setup.sh` first"
    text, _ = script(block)
    try:
        done = subprocess.run(
            ["bash", "-c", text],
            cwd=workdir(block, tmp_path),
            env=environment(block, tmp_path),
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(
            f"{block.name}: still running after {BLOCK_TIMEOUT_S} s:\n{text}\n{exc.stdout}\n{exc.stderr}"
        )
    assert done.returncode == 0, (
        f"{block.name} failed (exit {done.returncode}):\n{text}\n--- stdout\n{done.stdout[-3000:]}"
        f"\n--- stderr\n{done.stderr[-3000:]}"
    )


SAMPLE = """text
```bash
bash launch/run.sh     # set up, then train
bash launch/test.sh    # the suite
```

<!-- test: bash launch/run.sh += --set train.waves=4 -->

```text
not run
```

```bash
echo "a # not a comment" # a comment
```
"""


def test_blocks_are_the_bash_fences_with_their_test_comments() -> None:
    found = blocks(SAMPLE)
    assert [(b.line, b.lines, b.appends) for b in found] == [
        (
            3,
            ["bash launch/run.sh     # set up, then train", "bash launch/test.sh    # the suite"],
            [("bash launch/run.sh", "--set train.waves=4")],
        ),
        (14, ['echo "a # not a comment" # a comment'], []),
    ]


def test_the_script_appends_before_the_comment_and_drops_the_left_out_lines() -> None:
    text, dropped = script(blocks(SAMPLE)[0])
    assert text == "set -euo pipefail\nbash launch/run.sh --set train.waves=4  # set up, then train\n"
    assert dropped == ["bash launch/test.sh"]


def test_a_test_comment_that_matches_no_line_fails() -> None:
    block = Block(1, ["hetpipe plan x.toml"], [("hetpipe train", "--set train.waves=4")])
    with pytest.raises(AssertionError, match="matches 0 lines"):
        script(block)


def test_comments_start_outside_quotes_after_a_blank() -> None:
    assert comment_start('echo "a # b" # c') == len('echo "a # b" ')
    assert comment_start("echo a#b") == len("echo a#b")
    assert code("hetpipe plan x.toml --out p.json   # 2. plan") == "hetpipe plan x.toml --out p.json"
