"""What `hsbuild doctor` finds about a vLLM build's server (env.server): it is reachable, it is the build's by its
own command line (a local server: the model, layer ids, staging folder, connector, dtype and flags, as a run checks
them: identity.py), and it returns the build's layers (one probe request with a fixed prompt, whose file goes
into the build's own staging subfolder and is removed after). A run waits for an unreachable server, and runs a
server whose command line cannot be read only with --trust-server: both are warnings."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

from builder.errors import HsbuildError
from builder.extract.backends.http_client import EngineRejected, EngineUnavailable, healthy, served_model
from builder.extract.backends.serving import FAIL, OK, WARN, DoctorRequest, Finding
from builder.extract.backends.staging import staging_name
from builder.extract.backends.vllm.identity import Expected, config_problems, read_server_config
from builder.extract.backends.vllm.states import engine_layer_ids


def server_finding(req: DoctorRequest) -> Finding:
    from builder.extract.backends.vllm.probe import probe, probe_problems, signature_differs  # noqa: PLC0415
    from builder.extract.model import Extractor  # noqa: PLC0415

    cfg = req.cfg
    url = cfg.server or "?"
    fix = f"start it with the command `hsbuild serve-command {req.build_root}` prints, or run with --launch"
    if not healthy(url):
        return Finding("env.server", WARN, f"{cfg.backend} server {url} is not reachable (a run waits for it)",
                       fix, {"server": url, "healthy": False})
    try:
        m = served_model(url)
    except (EngineUnavailable, EngineRejected) as e:
        return Finding("env.server", WARN, f"{url}: cannot list its model ({e})", fix, {"server": url})
    data: dict = {"server": url, "healthy": True, "model_id": m.id, "root": m.root, "max_model_len": m.max_model_len}

    ex = Extractor(cfg.model, cfg.aux_layers or None, cfg.dtype, device="cpu", load_weights=False)
    meta = req.meta()
    want = Expected(model=str(Path(cfg.model).absolute()), staging=str(Path(cfg.staging or "").absolute()),
                    layer_ids=list(meta.get("engine_layer_ids") or engine_layer_ids(ex.aux_layers, ex.num_layers)),
                    dtype=cfg.dtype)  # as command.py's engine_spec
    data["expected"] = dataclasses.asdict(want)
    conf = read_server_config(url)
    if isinstance(conf, str):  # another host, namespace or a proxy: judged by its answers alone
        data["unreadable"] = conf
        unread = (f"; its configuration cannot be read ({conf}): a run refuses it unless --trust-server "
                  "(then judged by its answers alone)")
    else:
        data["process"] = conf.as_dict()
        problems = config_problems(conf, want)
        if problems:
            return Finding("env.server", FAIL, f"{url} (pid {conf.pid}) " + "; ".join(problems), fix, data)
        unread = ""
    trust_fix = (f"run the server on this machine, where its command line can be read, or pass --trust-server to "
                 f"`hsbuild run {req.build_root}`") if unread else None
    if req.live:  # a run is using it: no probe request of ours in its staging folder
        return Finding("env.server", WARN if unread else OK,
                       f"{url} serves {m.root} (a run is using it; not probed){unread}", trust_fix, data)

    staging = Path(want.staging) / staging_name(meta)  # the build's own subfolder: the server writes only there
    made = not staging.exists()
    try:
        staging.mkdir(exist_ok=True)  # (the staging folder itself is storage.staging's)
        p = probe(url, ex.vocab_size, 60.0, staging=staging)
    except (EngineRejected, HsbuildError, KeyError, OSError) as e:  # OSError: EngineUnavailable, a timeout, mkdir
        return Finding("env.server", FAIL, f"{url} serves {m.root}, but the probe request failed: {e}", fix, data)
    finally:
        for f in staging.glob("probe-*"):  # a probe that failed half-way leaves its file
            f.unlink(missing_ok=True)
        if made:
            with contextlib.suppress(OSError):
                staging.rmdir()
    data.update(layers=p.layers, hidden=p.hidden, dtype=p.dtype, want_layer_ids=want.layer_ids)
    problems = probe_problems(p, want.layer_ids, ex.hidden_size, cfg.dtype)
    ref = (req.first_probe() or {}).get("signature")
    if not problems and ref:
        rel = signature_differs(p.signature, ref)
        if rel is not None:
            problems.append(f"returns other states for the probe prompt than the build's reference probe (largest "
                            f"relative difference {rel:.1%}): another model or other layers")
    if problems:
        return Finding("env.server", FAIL, f"{url} serves {m.root} but " + "; ".join(problems), fix, data)
    summary = (f"{url} serves {m.root}: {p.layers} layer slots (ids {want.layer_ids}), hidden {p.hidden}, "
               f"{p.dtype}{unread}")
    return Finding("env.server", WARN if unread else OK, summary, trust_fix, data, serving=True)
