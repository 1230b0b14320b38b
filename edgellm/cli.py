"""The `edgellm` command: `serve` runs the node, `batch-run` sends a batch, `infer` runs a TensorRT-Edge-LLM
batch file in-process, `synth` makes synthetic records through a node, `doctor` checks the engine on this
machine, `pull` fetches a model, `ratio1-node` runs a Ratio1 node, `ratio1-install` installs the plugins into one."""

from __future__ import annotations

import argparse
import logging
import sys

from edgellm.cli_batch import add_batch_arguments, run_batch_command
from edgellm.cli_serve import SERVE_FLAGS, run_serve, serve_overrides
from edgellm.errors import EdgeLLMError


def _synth(args: argparse.Namespace) -> int:
    """Exit 0 when OUTPUT holds COUNT valid records, 1 when fewer, 2 for unusable input, 130 on Ctrl-C."""
    from edgellm.synth.cli import run_synth_command

    return run_synth_command(args)


def _doctor(args: argparse.Namespace) -> int:
    """Exit 0 when the engine loads and passes its self-test here, 1 when it does not, 2 for bad settings."""
    from edgellm.runtime.doctor import run_doctor
    from edgellm.runtime.settings import load_settings

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return run_doctor(load_settings(args.config, **serve_overrides(args)))


def _ratio1_node(args: argparse.Namespace) -> int:
    from edgellm.ratio1.node_command import run

    return run(args.venv, args.port, args.workdir, args.mqtt_port, args.pipelines)


def _ratio1_install(args: argparse.Namespace) -> int:
    from edgellm.ratio1.install import InstallError, install

    try:
        for line in install(args.app_dir, take_over=args.take_over_llm_inference_api):
            print(line)
    except InstallError as exc:
        print(f"edgellm ratio1-install: {exc}", file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgellm", description="LLM inference node for edge devices")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the node (HTTP API + engine worker)")
    serve.add_argument("--config", help="YAML settings file (e.g. configs/node.yaml)")
    for flag, typ, help_text in SERVE_FLAGS:
        serve.add_argument(f"--{flag}", type=typ, help=help_text)
    serve.set_defaults(func=run_serve)

    batch = sub.add_parser(
        "batch-run",
        help="send requests.json to an OpenAI-compatible endpoint (or run it in-process: --local) -> results.jsonl",
    )
    add_batch_arguments(batch)
    batch.set_defaults(func=run_batch_command)

    doctor = sub.add_parser(
        "doctor",
        help="check the engine on this machine: build flags, CPU features, memory plan, offload, and a real "
        "batched decode (the settings and flags of `serve`)",
    )
    doctor.add_argument("--config", help="YAML settings file, as for `edgellm serve`")
    for flag, typ, help_text in SERVE_FLAGS:
        doctor.add_argument(f"--{flag}", type=typ, help=help_text)
    doctor.set_defaults(func=_doctor)

    node = sub.add_parser(
        "ratio1-node",
        help="run an offline Ratio1 edge node (naeural-core + local mosquitto) serving this repo's plugins",
    )
    node.add_argument(
        "--venv", help="the node's venv (tools/ratio1_venv.sh; default $EDGELLM_RATIO1_PYTHON or this one)"
    )
    node.add_argument("--port", type=int, help="HTTP port of the first EDGELLM_INFERENCE_API instance (default 15080)")
    node.add_argument(
        "--workdir", help="the node's folder: configs, logs, identity key (default ~/.local/state/edgellm/ratio1-node)"
    )
    node.add_argument("--mqtt-port", type=int, help="local broker port (default 1883, or a free one if taken)")
    node.add_argument("--pipelines", help="folder of pipeline JSON files (default configs/ratio1/pipelines)")
    node.set_defaults(func=_ratio1_node)

    inst = sub.add_parser(
        "ratio1-install",
        help="add EDGELLM_INFERENCE_API to a stock edge node's app folder (beside upstream's LLM_INFERENCE_API)",
    )
    inst.add_argument("app_dir", help="the node's app folder: device.py and extensions/ (/edge_node in the image)")
    inst.add_argument(
        "--take-over-llm-inference-api",
        action="store_true",
        help="also make LLM_INFERENCE_API mean edgellm (upstream's file is kept as llm_inference_api.py.upstream); "
        "without it, an alias an earlier run wrote is removed",
    )
    inst.set_defaults(func=_ratio1_install)

    infer = sub.add_parser(
        "infer", help="run a TensorRT-Edge-LLM input JSON on the local engine (no server) -> output JSON"
    )
    from edgellm.cli_infer import add_infer_arguments, run_infer_command

    add_infer_arguments(infer)
    infer.set_defaults(func=run_infer_command)

    pull = sub.add_parser(
        "pull", help="download a model (a preset's, a URL, hf://ORG/NAME/FILE): resumable, sha256-checked"
    )
    from edgellm.pull.cli import add_pull_arguments, run_pull

    add_pull_arguments(pull)
    pull.set_defaults(func=run_pull)

    synth = sub.add_parser("synth", help="generate schema-valid synthetic JSON records through a node -> JSONL")
    from edgellm.synth.cli import add_synth_arguments

    add_synth_arguments(synth)
    synth.set_defaults(func=_synth)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # what a crash-guarded command (infer, batch-run --local) runs again in its child
    try:
        return args.func(args)
    except EdgeLLMError as exc:
        print(f"edgellm: {exc.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
