"""What data v6 is for (issue 27): a path in a call can only be copied from the prompt, and the
pieces a real temporary directory's path tokenizes into are trained. Session 15 measured, through
real Claude Code in `tempfile.mkdtemp()` directories, that 48% of those paths' tokens were ids
data v5 never held (the compact model reads them all as one unknown row) and that 27% of v5's
held-out working directories occur verbatim in its training data (it recalls paths)."""
from __future__ import annotations

import random
import re
import tempfile

import pytest

from freetoken.chat.compaction import env_lines
from freetoken.chat.tokenizer import ChatTokenizer
from freetoken.models import demo_data as dd
from freetoken.models.demo import tokenizer_source_dir

# tempfile's name characters, spelled out here (not the generator's constant): checked below
MKDTEMP_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789_"
# the two places a working directory sits in a compacted prompt: the environment line beside
# the task, and a call's absolute path
CONTEXTS = (("Working directory:", "Working directory: PATH\n"),
            ('{"file_path":', '{"file_path": "PATH/notes.txt"}'))


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    return ChatTokenizer.from_dir(tokenizer_source_dir())


def test_mkdtemp_names_are_what_the_fresh_paths_imitate(tmp_path) -> None:
    assert set(tempfile._RandomNameSequence.characters) == set(MKDTEMP_CHARS)
    names = [tempfile.mkdtemp(dir=tmp_path).rsplit("/", 1)[1] for _ in range(5)]
    assert all(re.fullmatch(r"tmp[a-z0-9_]{8}", n) for n in names), names


def _path_ids(tok: ChatTokenizer, path: str) -> list[int]:
    """The ids the path takes in each context (what follows the context's own tokens)."""
    out = []
    for head, text in CONTEXTS:
        a, b = tok.encode(head), tok.encode(text.replace("PATH", path))
        assert b[:len(a)] == a
        out += b[len(a):]
    return out


def _coverage(tok: ChatTokenizer, seen: set[int]) -> tuple[float, float]:
    """(all tokens, random-part tokens): of 200 fresh mkdtemp-shaped paths' token ids in the
    prompt contexts, the fraction in `seen`; random-part: leaving out the ids a bare `/tmp/tmp`
    takes there."""
    rng = random.Random(2026)
    paths = ["/tmp/tmp" + "".join(rng.choice(MKDTEMP_CHARS) for _ in range(8))
             for _ in range(200)]
    ids = [t for p in paths for t in _path_ids(tok, p)]
    fixed = set(_path_ids(tok, "/tmp/tmp"))
    rand = [t for t in ids if t not in fixed]
    return (sum(t in seen for t in ids) / len(ids), sum(t in seen for t in rand) / len(rand))


def test_v6_trains_the_pieces_of_real_temporary_paths(tok) -> None:
    """Bug this catches: path parts drawn from too few names (v5: word lists) or a different
    alphabet, which leaves a real mkdtemp path's pieces untrained. 1,200 samples (a fortieth of
    the 72k the training run makes): >= 98% of the ids are trained in v6; v5's same-sized set
    misses about a quarter of them."""
    def sample_ids(version: int) -> set[int]:
        return {t for s in dd.generate({n: 200 for n in dd.HARNESSES}, 0, tok, version=version)
                for t in s.ids}

    v6_all, v6_rand = _coverage(tok, sample_ids(6))
    v5_all, v5_rand = _coverage(tok, sample_ids(5))
    print(f"mkdtemp path token coverage (all / random part): v5 {v5_all:.3f} / {v5_rand:.3f}, "
          f"v6 {v6_all:.3f} / {v6_rand:.3f}")
    assert v6_all >= 0.98 and v6_rand >= 0.96, (v6_all, v6_rand)
    assert v5_all < 0.85, v5_all  # the gap v6 closes (the check can fail)


def test_the_shipped_weights_know_the_pieces_their_data_version_trains(tok) -> None:
    """The same paths against the shipped model's own trained ids (`used_ids`: every other id
    is the shared unknown row): v5 weights miss a quarter or more, weights of v6 data (or
    later) must not. Keyed to the manifest: it checks v6's claim by itself once they ship."""
    from safetensors.torch import load_file

    from freetoken.models import demo_trained as dt

    used = {int(t) for t in load_file(str(dt.WEIGHTS_DIR / dt.COMPACT))["used_ids"]}
    version, _ = dt.trained_data()
    cov_all, cov_rand = _coverage(tok, used)
    print(f"shipped weights (data v{version}, {len(used)} ids): {cov_all:.3f} / {cov_rand:.3f}")
    if version >= 6:
        assert cov_all >= 0.98, cov_all
    else:
        assert cov_all < 0.85, cov_all


def _cwds(seed: int, n: int, version: int) -> list[str]:
    """The working directories of the first `n` Claude Code conversations of `seed` (the
    training run's draws: `shard_conversations`)."""
    out = []
    for k in range(-(-n // dd.SHARD)):
        for body, _, _ in dd.shard_conversations("claude_code", k, min(dd.SHARD, n - k * dd.SHARD),
                                                 seed, version=version):
            system = "".join(b["text"] for b in body["system"])
            out.append(system.split("Primary working directory: ", 1)[1].split("\n", 1)[0])
    return out


def test_held_out_working_directories_are_not_in_training(tok) -> None:
    """Bug this catches: working directories a model can score on by recalling them (v5: 10%
    of 1,000 held-out ones occur among 1,000 training ones, 33% at 12,000; v6 measured 0 at
    1,000 and 0.3% at 24,000)."""
    rates = {}
    for version in (5, 6):
        train = set(_cwds(0, 1000, version))
        held = _cwds(12345, 1000, version)
        assert len(set(held)) > 900
        rates[version] = sum(c in train for c in held) / len(held)
    print(f"held-out cwds found in training: {rates}")
    assert rates[6] <= 0.01, rates
    assert rates[5] >= 0.05, rates  # the check can fail
    mk = sum(c.startswith("/tmp/tmp") and len(c) == 16 for c in _cwds(7, 300, 6))
    assert 0.3 * 300 < mk < 0.5 * 300  # the mkdtemp-like share (40%)


def _strings(obj) -> list[str]:
    if isinstance(obj, str):
        return [obj]
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list) else []
    return [s for v in items for s in _strings(v)]


@pytest.mark.parametrize("version", [5, 6])
def test_claude_code_reads_through_its_shell_from_v6(version: int) -> None:
    """v6's Claude Code conversations read with `cat <relative path>` in Bash (no working
    directory to copy) and write with Write at `cwd/path`; v5's read with Read at `cwd/path`.
    Every read and write task of 60 conversations is checked against the request's own
    working directory. Bug it catches: a read left on Read (the model would still have to copy
    the directory), or a shell read given the absolute path."""
    seen = {"read": 0, "write": 0}
    for body, tasks, _ in dd.shard_conversations("claude_code", 0, 60, 0, version=version):
        calls = [b for m in body["messages"] if m["role"] == "assistant"
                 and isinstance(m["content"], list) for b in m["content"]
                 if b.get("type") == "tool_use"]
        cwd = env_lines("\n".join(_strings(body)))[0].removeprefix("Working directory: ")
        tool_tasks = [t for t in tasks if t.kind != "chat"]
        assert len(calls) == len(tool_tasks)
        for t, c in zip(tool_tasks, calls):
            if t.kind == "read":
                seen["read"] += 1
                want = (("Bash", {"command": f"cat {t.path}", "description": f"Show {t.path}"})
                        if version >= 6 else ("Read", {"file_path": f"{cwd}/{t.path}"}))
                assert (c["name"], c["input"]) == want
            elif t.kind == "write":
                seen["write"] += 1
                assert c["name"] == "Write" and c["input"]["file_path"] == f"{cwd}/{t.path}"
    assert seen["read"] > 10 and seen["write"] > 5, seen
