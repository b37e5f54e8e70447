"""The engine flags of the ``pagedllm`` command come from ``EngineArgs`` (``add_cli_args``).

Pure argparse: no model is loaded.
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from pagedllm.config import EngineArgs
from pagedllm.entrypoints.cli import build_parser
from pagedllm.entrypoints.openai.cli_args import ServerArgs, parse_serve_args

# Every command that takes the engine flags: (argv before the flags, positional arguments).
COMMANDS = [["generate", "hello"], ["serve"], ["bench", "throughput"], ["bench", "memory"],
            ["bench", "accuracy"]]

# The flags as users knew them before they were generated from EngineArgs: option strings, type
# (what a value is converted with; before, --model and --dtype had none, the same as str), choices,
# default.
EXISTING_FLAGS = {
    "model": (["--model"], str, None, None),
    "dtype": (["--dtype"], str, None, "auto"),
    "max_model_len": (["--max-model-len"], int, None, None),
    "block_size": (["--block-size"], int, None, 16),
    "kv_cache_memory_bytes": (["--kv-cache-memory-bytes"], int, None, None),
    "memory_utilization": (["--memory-utilization", "--gpu-memory-utilization"], float, None, 0.9),
    "max_num_seqs": (["--max-num-seqs"], int, None, 256),
    "max_num_batched_tokens": (["--max-num-batched-tokens"], int, None, 2048),
    "enable_prefix_caching": (["--enable-prefix-caching", "--no-enable-prefix-caching"], None, None, True),
    "seed": (["--seed"], int, None, 0),
    "quantization": (["--quantization"], str, ["int8", "int4", "w8a8", "w4a8", "awq", "gptq", "compressed-tensors"], None),
    "kv_cache_dtype": (["--kv-cache-dtype"], str, ["auto", "bfloat16", "float32", "int8"], "auto"),
}


def subparser(argv: list[str]) -> argparse.ArgumentParser:
    """The parser of the command that ``argv`` starts with."""
    parser = build_parser()
    for name in argv:
        subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subparsers:
            break
        parser = subparsers[0].choices[name]
    return parser


def engine_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    (group,) = [g for g in parser._action_groups if g.title == "engine"]
    return {action.dest: action for action in group._group_actions}


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_every_engine_args_field_has_a_flag(argv):
    actions = engine_actions(subparser(argv))
    assert sorted(actions) == sorted(field.name for field in dataclasses.fields(EngineArgs))
    for field in dataclasses.fields(EngineArgs):
        assert "--" + field.name.replace("_", "-") in actions[field.name].option_strings
        assert actions[field.name].help.startswith(field.metadata["help"])


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_existing_flags_keep_their_names_types_choices_and_defaults(argv):
    actions = engine_actions(subparser(argv))
    for dest, (option_strings, kind, choices, default) in EXISTING_FLAGS.items():
        action = actions[dest]
        if argv == ["bench", "throughput"] and dest == "enable_prefix_caching":
            default = False  # repeated runs of one workload would be served from the cache
        action_choices = None if action.choices is None else list(action.choices)
        assert (action.option_strings, action.type, action_choices, action.default) == \
            (option_strings, kind, choices, default), dest
    assert isinstance(actions["enable_prefix_caching"], argparse.BooleanOptionalAction)


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_parsing_no_flags_gives_the_dataclass_defaults(argv):
    args = build_parser().parse_args(argv)
    expected = EngineArgs()
    if argv == ["bench", "throughput"]:
        expected = dataclasses.replace(expected, enable_prefix_caching=False)
    assert EngineArgs.from_cli_args(args) == expected
    assert args.log_level == ("INFO" if argv == ["serve"] else "WARNING")


def test_flags_are_parsed_into_engine_args():
    args = build_parser().parse_args([
        "serve", "some/model", "--dtype", "float32", "--max-model-len", "128", "--block-size", "8",
        "--kv-cache-memory-bytes", "1048576", "--gpu-memory-utilization", "0.5", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "64", "--no-enable-prefix-caching", "--seed", "3", "--quantization", "int4",
        "--kv-cache-dtype", "bfloat16", "--num-gpu-blocks-override", "40"])
    assert EngineArgs.from_cli_args(args) == EngineArgs(
        dtype="float32", max_model_len=128, block_size=8, kv_cache_memory_bytes=2**20, memory_utilization=0.5,
        max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=False, seed=3, quantization="int4",
        kv_cache_dtype="bfloat16", num_gpu_blocks_override=40)
    assert args.model_tag == "some/model"


@pytest.mark.parametrize("flags,message", [(["--block-size", "0"], "block_size must be a positive integer"),
                                           (["--tensor-parallel-size", "2", "--tp-cores", "0-1"],
                                            "tp_cores gives 1 CPU lists, tensor_parallel_size is 2")])
def test_from_cli_args_checks_the_options(flags, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs.from_cli_args(build_parser().parse_args(["generate", "hello", *flags]))


def test_help_shows_the_defaults():
    help_text = " ".join(subparser(["serve"]).format_help().split())
    assert "--gpu-memory-utilization" in help_text
    assert "tokens per KV block (default 16)" in help_text
    assert "(default 0.9)" in help_text
    assert "reuse KV blocks of identical prompt prefixes (default" in help_text
    assert "prefixes (default False)" in " ".join(subparser(["bench", "throughput"]).format_help().split())


@pytest.mark.parametrize("value", ["yes", 1, "False"])
def test_enable_prefix_caching_must_be_a_bool(value):
    """Found by the fresh-user check: enable_prefix_caching="yes" was accepted."""
    with pytest.raises(ValueError, match=rf"enable_prefix_caching must be True or False, got {value!r}"):
        EngineArgs(enable_prefix_caching=value).verify()


def test_enable_prefix_caching_none_means_the_default_as_in_vllm():
    args = EngineArgs(enable_prefix_caching=None)
    args.verify()
    assert args.enable_prefix_caching is True


def test_ctrl_c_exits_130_with_one_line_and_no_traceback(monkeypatch, capsys):
    from pagedllm.entrypoints import cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_models", interrupted)
    assert cli.main(["models"]) == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_serve_refuses_to_start_without_the_cpp_ops(monkeypatch, capsys):
    """A server never falls back to the torch references by itself (they are a test oracle,
    many times slower); it says why the ops did not load, and how to serve anyway."""
    from pagedllm.entrypoints import cli
    from pagedllm.layers import ops

    monkeypatch.delenv("PAGEDLLM_NATIVE_OPS", raising=False)
    monkeypatch.setattr(ops, "native_ops_error", lambda: "pagedllm/_C_avx2.*.so is not built")
    assert cli.main(["serve", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "C++ ops cannot be loaded: pagedllm/_C_avx2.*.so is not built" in err and "PAGEDLLM_NATIVE_OPS=0" in err


def test_serve_runs_the_torch_path_when_asked(monkeypatch):
    from pagedllm.entrypoints import cli
    from pagedllm.layers import ops

    monkeypatch.setenv("PAGEDLLM_NATIVE_OPS", "0")
    assert ops.native_ops_error() is None
    started = []
    monkeypatch.setattr("pagedllm.entrypoints.openai.api_server.run_server", lambda *args: started.append(1) or 0)
    assert cli.main(["serve", "--port", "1"]) == 0 and started == [1]


def test_the_docs_options_table_is_the_one_engine_args_generates(capsys):
    """docs/configuration.md's table is ``docs/gen_options.py``'s output, so it cannot drift from
    ``EngineArgs``' help text (it had: a hand copy)."""
    import runpy
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    runpy.run_path(str(root / "docs" / "gen_options.py"))["main"]()
    table = capsys.readouterr().out
    doc = (root / "docs" / "configuration.md").read_text()
    start = doc.index("<!-- options table: generated by docs/gen_options.py, do not edit by hand -->\n")
    generated = doc[doc.index("\n", start) + 1:doc.index("<!-- end of options table -->")]
    assert generated == table, "regenerate: .venv/bin/python docs/gen_options.py (see its docstring)"


def test_no_tracked_file_names_a_developer_machines_path():
    """Scripts and docs use repository-relative paths (./.venv, $PAGEDLLM_PEERS_DIR), never one
    machine's layout (/work/venv, /root/...)."""
    import re
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    pattern = re.compile(r"/work/|/root/|/home/[a-z]")
    files = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout.split()
    offenders = []
    for name in files:
        path = root / name
        if path.suffix in (".png", ".jpg") or not path.is_file():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line) and Path(name) != Path(__file__).relative_to(root):
                offenders.append(f"{name}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_serve_flags_are_parsed_into_server_args():
    """Every ``ServerArgs`` field is a ``pagedllm serve`` flag with its help, and no flags give
    the dataclass defaults."""
    actions = {action.dest: action for action in subparser(["serve"])._actions}
    for field in dataclasses.fields(ServerArgs):
        assert "--" + field.name.replace("_", "-") in actions[field.name].option_strings
        assert actions[field.name].help.startswith(field.metadata["help"])
    assert parse_serve_args(build_parser().parse_args(["serve"])) == (ServerArgs(), EngineArgs())
    server_args, _ = parse_serve_args(build_parser().parse_args([
        "serve", "--served-model-name", "a", "b", "--disable-dashboard", "--router", "pow2", "--replicas", "2",
        "--max-queue-wait", "1.5"]))
    assert server_args == ServerArgs(served_model_name=["a", "b"], disable_dashboard=True, router="pow2", replicas=2,
                                     max_queue_wait=1.5)


@pytest.mark.parametrize("flags,message", [
    (["--drain-timeout", "-1"], "drain_timeout must be >= 0 seconds, got -1.0"),
    (["--max-queue-wait", "0"], "max_queue_wait must be > 0 seconds, got 0.0"),
    (["--max-request-body-bytes", "0"], "max_request_body_bytes must be >= 1, got 0"),
    (["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "m=/x", "--served-model-name", "m"], r"\['m'\] are also base model names"),
    (["--enable-lora", "--lora-modules", "a=/x", "--replicas", "2"], "not served by Ray Serve replicas")])
def test_server_args_verify_names_the_option_and_value(flags, message):
    with pytest.raises(ValueError, match=message):
        parse_serve_args(build_parser().parse_args(["serve", *flags]))


def test_generate_takes_token_ids_for_a_model_without_a_tokenizer(capsys):
    """``generate --prompt-token-ids`` runs a dummy model (no tokenizer) and prints the new
    token ids: those of ``LLM.generate`` on the same prompt; text for such a model, both
    prompts or neither, and a non-integer id are refused with exit code 2 and one line."""
    from pathlib import Path

    from pagedllm import LLM, SamplingParams
    from pagedllm.entrypoints.cli import main

    config = str(Path(__file__).resolve().parent.parent / "bench" / "configs" / "tiny-llama.json")
    model = ["--model", config, "--load-format", "dummy", "--max-tokens", "6"]
    assert main(["generate", "--prompt-token-ids", "5, 9 17", *model]) == 0
    printed = [int(t) for t in capsys.readouterr().out.split()]
    llm = LLM(model=config, load_format="dummy")
    (expected,) = llm.generate({"prompt_token_ids": [5, 9, 17]}, SamplingParams(temperature=0, max_tokens=6))
    assert printed == list(expected.outputs[0].token_ids) and len(printed) == 6
    for argv, message in ((["generate", "hello", *model], "give --prompt-token-ids"),
                          (["generate", *model], "not both or neither"),
                          (["generate", "hi", "--prompt-token-ids", "1", *model], "not both or neither"),
                          (["generate", "--prompt-token-ids", "1,x", *model], "got '1,x'")):
        assert main(argv) == 2
        assert message in capsys.readouterr().err
