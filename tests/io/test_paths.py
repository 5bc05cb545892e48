"""Model paths the system refuses, or that do not exist, end in one clear error (never a
traceback, never a hub lookup for what is plainly a local path), and ``lorakit ... |
head`` stops quietly with status 141 like other Unix tools."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import lorakit
from lorakit.errors import FormatError
from lorakit.io.formats.checkpoint import Checkpoint
from lorakit.io.formats.paths import resolve_model_path

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def here(tmp_path: Path, monkeypatch) -> Path:
    """A working directory holding ``data/tiny-qwen3/`` (no weights needed)."""
    (tmp_path / "data" / "tiny-qwen3").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LORAKIT_OFFLINE", raising=False)
    return tmp_path


def _no_hub(monkeypatch) -> None:
    """Any hub lookup fails the test: these paths must be answered locally."""
    import mlx_lm.utils

    def fail(*a, **k):
        raise AssertionError("asked the hub for a local-looking path")
    monkeypatch.setattr(mlx_lm.utils, "_download", fail)


@pytest.mark.parametrize("given", ["data/tiny-qwen", "./x", "../x", "/nonexistent/model",
                                   "x/y/z", "tiny-qwen3", "data/tiny-qwen3/sub"])
def test_local_typo_says_no_such_directory(here: Path, given: str, monkeypatch) -> None:
    _no_hub(monkeypatch)
    with pytest.raises(FormatError) as info:
        lorakit.open(given, checkpoint=True)
    msg = str(info.value)
    assert "no such directory" in msg and "model path does not exist" in msg, msg
    assert "found: no such file or directory" in msg


def test_typo_hint_names_the_close_directory(here: Path, monkeypatch) -> None:
    _no_hub(monkeypatch)
    with pytest.raises(FormatError, match=r"did you mean data/tiny-qwen3\?"):
        resolve_model_path("data/tiny-qwen")


def test_repo_shaped_id_without_local_owner_goes_to_the_hub(here: Path, monkeypatch) -> None:
    import mlx_lm.utils

    asked = []
    monkeypatch.setattr(mlx_lm.utils, "_download", lambda repo: asked.append(repo) or here)
    assert resolve_model_path("some-owner/some-model") == here
    assert asked == ["some-owner/some-model"]


def test_unknown_user(here: Path, monkeypatch) -> None:
    _no_hub(monkeypatch)
    for fn in (lorakit.open, Checkpoint):
        with pytest.raises(FormatError, match="unknown user") as info:
            fn("~no-such-user-lorakit/model")
        assert "no-such-user-lorakit" in str(info.value)


def test_home_is_expanded(here: Path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(here))
    assert resolve_model_path("~/data/tiny-qwen3") == here / "data" / "tiny-qwen3"


@pytest.mark.parametrize("given", ["a" * 300, "data/" + "b" * 300, "c" * 300 + "/x"])
def test_name_too_long(here: Path, given: str, monkeypatch) -> None:
    _no_hub(monkeypatch)
    for fn in (lorakit.open, Checkpoint):
        with pytest.raises(FormatError, match="longer than the system allows") as info:
            fn(given)
        assert "ENAMETOOLONG" in str(info.value)
        assert len(str(info.value)) < 600  # the name is shortened, not printed whole


def test_a_file_is_not_a_model_directory(here: Path) -> None:
    (here / "afile").write_text("x")
    with pytest.raises(FormatError, match="not a directory") as info:
        lorakit.open("afile", checkpoint=True)
    assert "found: a file" in str(info.value)


def _without_root_powers() -> list:
    """A prefix that runs a command without root's permission bypass (or nothing)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: permissions cannot be tested")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]


@pytest.mark.slow
def test_permission_denied(tmp_path: Path) -> None:
    """A model directory (or one above it) that cannot be read: one clear error."""
    locked = tmp_path / "locked"
    (locked / "inner").mkdir(parents=True)
    locked.chmod(0)
    code = ("import sys\nimport lorakit\n"
            "from lorakit.errors import FormatError\n"
            "for m in sys.argv[1:]:\n"
            "    try:\n        lorakit.open(m, checkpoint=True)\n"
            "    except FormatError as e:\n        print(str(e).splitlines()[0])\n")
    try:
        r = subprocess.run(_without_root_powers() + [sys.executable, "-c", code, "locked/inner",
                                                     "locked"], cwd=tmp_path, text=True,
                           capture_output=True, timeout=60,
                           env=dict(os.environ, PYTHONPATH=str(REPO)))
    finally:
        locked.chmod(0o755)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["cannot use the model path: permission denied"] * 2, r.stdout


def _cli(*args: str, cwd: Path, stdout=subprocess.PIPE) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "lorakit", *args], cwd=cwd, stdout=stdout,
                            stderr=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=str(REPO)))


@pytest.mark.slow
@pytest.mark.parametrize("model", ["data/tiny-qwen", "~no-such-user-lorakit/m", "a" * 300])
def test_cli_path_errors_are_one_line(here: Path, model: str) -> None:
    p = _cli("fuse", "--model", model, "--adapter-path", str(here / "ad"), "--save-path",
             str(here / "out"), "-q", cwd=here)
    out, err = p.communicate(timeout=120)
    err = err.decode()
    assert p.returncode == 2, err
    assert "Traceback" not in err and err.startswith("lorakit fuse: error: "), err
    assert not (here / "out").exists()


def _tiny_checkpoint(d: Path) -> Path:
    """A checkpoint of 40 small tensors, written without mlx: ``inspect`` prints ~50 lines."""
    import json

    import numpy as np

    from lorakit.io.formats.safetensors import TensorSpec
    from lorakit.io.outputs.safetensors_write import SafetensorsWriter

    d.mkdir()
    names = [f"model.layers.{i}.mlp.up_proj.weight" for i in range(40)]
    with SafetensorsWriter(d / "model.safetensors",
                           [TensorSpec(n, "F16", (2, 2)) for n in names]) as w:
        for n in names:
            w.write(n, np.zeros((2, 2), np.float16))
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return d


@pytest.mark.slow
def test_closed_stdout_exits_quietly(tmp_path: Path) -> None:
    """The reader of stdout goes away before lorakit writes (``| head`` that already
    exited): no traceback, no "Exception ignored", status 141 (128 + SIGPIPE)."""
    ck = _tiny_checkpoint(tmp_path / "tiny")
    p = _cli("inspect", str(ck), cwd=tmp_path)
    p.stdout.close()  # nobody reads: the first write fails with EPIPE
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141, err
    assert err == "", err


@pytest.mark.slow
def test_head_in_a_shell_pipeline(tmp_path: Path) -> None:
    """``lorakit inspect ... | head -1`` as a user types it: one line, nothing on stderr."""
    ck = _tiny_checkpoint(tmp_path / "tiny")
    r = subprocess.run(f"{sys.executable} -m lorakit inspect {ck} | head -1",
                       shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.stdout == "dtype map of tiny\n" and r.stderr == "", r.stderr


@pytest.mark.slow
def test_cli_os_errors_on_other_paths_are_one_message(here: Path) -> None:
    """A path the system refuses anywhere (here a 300-byte output name) is one message,
    exit 2, its name shortened."""
    import json

    import numpy as np

    from lorakit.io.formats.safetensors import TensorSpec
    from lorakit.io.outputs.safetensors_write import SafetensorsWriter

    ck = _tiny_checkpoint(here / "tiny")
    ad = here / "ad"  # a rank-1 mlx-lm LoRA on the last layer's up_proj
    ad.mkdir()
    leaves = {"model.layers.39.mlp.up_proj.lora_a": (2, 1),
              "model.layers.39.mlp.up_proj.lora_b": (1, 2)}
    with SafetensorsWriter(ad / "adapters.safetensors",
                           [TensorSpec(n, "F32", s) for n, s in leaves.items()]) as w:
        for n, s in leaves.items():
            w.write(n, np.full(s, 0.5, np.float32))
    (ad / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": 1,
         "lora_parameters": {"rank": 1, "scale": 1.0, "keys": ["mlp.up_proj"]}}))
    p = _cli("fuse", "--model", str(ck), "--adapter-path", str(here / "ad"), "--save-path",
             "o" * 300, "-q", cwd=here)
    _, err = p.communicate(timeout=120)
    err = err.decode()
    assert p.returncode == 2 and "Traceback" not in err, err
    assert err.startswith("lorakit fuse: error: ") and len(err) < 600, err
    assert "too long" in err, err


@pytest.mark.parametrize("link", ["adapters.safetensors", "adapter_config.json"])
def test_every_verb_refuses_a_link_out_of_an_adapter_folder(tmp_path: Path, link: str) -> None:
    """diff, inspect and fuse read an adapter folder by the same rule: a file linked to
    a place outside the folder is refused before it is parsed (the outside file here is
    not even a safetensors file: parsing it first would give another error)."""

    ad = tmp_path / "ad"
    shutil.copytree(REPO / "data" / "adapters" / "lora", ad)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"\xff" * 64)
    (ad / link).unlink()
    (ad / link).symlink_to(outside)
    for argv in (["diff", str(ad), str(REPO / "data" / "adapters" / "lora")],
                 ["inspect", str(ad)],
                 ["fuse", "--model", str(REPO / "data" / "tiny-qwen3"), "--adapter-path", str(ad),
                  "--save-path", str(tmp_path / "out"), "-q"]):
        proc = subprocess.run([sys.executable, "-m", "lorakit", *argv], capture_output=True,
                              text=True, cwd=REPO)
        assert proc.returncode == 2, (argv, proc.stdout, proc.stderr)
        assert "link out of the directory" in proc.stderr and str(outside) in proc.stderr, \
            (argv[0], proc.stderr)
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_fuse_started_with_stdout_closed_completes(tmp_path: Path) -> None:
    """``lorakit fuse ... >&-``: no stdout at all. The fuse completes (status 0, output
    whole), its summary has nowhere to go, and nothing is printed as a traceback."""
    out = tmp_path / "o"
    proc = subprocess.run([sys.executable, "-m", "lorakit", "fuse", "--model",
                           str(REPO / "data" / "tiny-qwen3"), "--adapter-path",
                           str(REPO / "data" / "adapters" / "lora"), "--save-path", str(out),
                           "-q"], stderr=subprocess.PIPE, text=True, cwd=REPO,
                          preexec_fn=lambda: os.close(1))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert (out / "lorakit.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("fmt", [[], ["--json"]])
def test_a_fuse_whose_stdout_reader_is_gone_completes(tmp_path: Path, fmt) -> None:
    """``lorakit fuse ... | true``: the reader of stdout is gone before the summary is
    printed. The output is whole, so the status is 0 (not 141, as for ``inspect | head``)
    and stderr has one note saying where it is; no traceback."""
    out = tmp_path / "o"
    p = subprocess.Popen([sys.executable, "-m", "lorakit", "fuse", *fmt, "--model",
                          str(REPO / "data" / "tiny-qwen3"), "--adapter-path",
                          str(REPO / "data" / "adapters" / "lora"), "--save-path", str(out),
                          "-q"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    p.stdout.close()  # nobody reads: printing the summary fails with EPIPE
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 0, err
    assert err == ("lorakit fuse: note: stdout was closed before the summary was printed; "
                   f"the output is complete at {out}\n"), err
    assert (out / "lorakit.json").is_file() and (out / "model.safetensors").is_file()
    assert sorted(q.name for q in tmp_path.iterdir()) == ["o"]


@pytest.mark.parametrize("link", ["config.json", "model.safetensors", "unindexed-shard"])
def test_diff_and_inspect_refuse_a_link_out_of_a_model_folder(tmp_path: Path, capsys,
                                                              link: str) -> None:
    """The model-folder twin of the adapter test above, in process: ``inspect`` and
    ``diff`` (either side) refuse a config or shard linked outside the folder as
    ``fuse`` does, before parsing it (the outside file is neither JSON nor safetensors)."""
    from lorakit.cli.main import main

    m = tmp_path / "m"
    shutil.copytree(REPO / "data" / "tiny-qwen3", m)
    name = "model.safetensors" if link == "unindexed-shard" else link
    if link == "unindexed-shard":
        (m / "model.safetensors.index.json").unlink()
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"\xff" * 64)
    (m / name).unlink()
    (m / name).symlink_to(outside)
    other = str(REPO / "data" / "tiny-qwen3")
    for argv in (["inspect", str(m)], ["diff", str(m), other], ["diff", other, str(m)],
                 ["fuse", "--model", str(m), "--adapter-path",
                  str(REPO / "data" / "adapters" / "lora"), "--save-path",
                  str(tmp_path / "out"), "-q"]):
        assert main(argv) == 2, argv
        cap = capsys.readouterr()
        assert cap.out == "" and cap.err.startswith(f"lorakit {argv[0]}: error: "), cap.err
        assert "is a link out of the directory" in cap.err and str(outside) in cap.err, cap.err
        assert f"file: {m / name}" in cap.err, cap.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "outside.bin"]
