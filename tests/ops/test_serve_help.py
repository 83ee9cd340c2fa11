"""`asyncengine serve --help` as a reader gets it: a description naming both protocols, flags in
argument groups, and entries that say what each flag does and its default (issue 25)."""

from __future__ import annotations

import re

import pytest

from asyncengine.server.cli import main

# the spec: which group each flag of `serve` is listed in
GROUPS = {
    "options": "--help",
    "server (gRPC)": "--host --port --served-model-name --reflection --max-message-size "
    "--max-concurrent-rpcs --keepalive-time --keepalive-timeout --min-client-ping-interval "
    "--max-connection-age --max-connection-idle --handshake-timeout --max-pending-rpcs "
    "--max-concurrent-streams",
    "OpenAI HTTP API": "--http-port --http-host --chat-template --http-header-timeout "
    "--http-body-timeout --http-keep-alive-timeout --http-max-connections",
    "LoRA adapters": "--lora-modules --allow-runtime-lora-updating",
    "admission, streams and drain": "--max-queued-requests --retry-after --heartbeat-interval "
    "--stall-timeout --drain-grace-period",
    "security": "--tls-cert --tls-key --tls-client-ca --auth-token --control-auth-token "
    "--auth-metrics",
    "observability": "--metrics-port --metrics-host --log-level",
    "engine process": "--engine-process --engine-heartbeat-timeout --torch-threads",
    "engine: model and device": "--model --tokenizer --dtype --device --attention-backend --seed",
    "engine: KV cache and scheduling": "--block-size --gpu-memory-utilization --swap-space "
    "--num-gpu-blocks-override --kv-cache-memory-bytes --num-cpu-blocks-override --max-num-seqs "
    "--max-num-batched-tokens --max-model-len --preemption-mode --enable-prefix-caching "
    "--enable-kv-events --expected-concurrency --max-prompt-bytes",
    "engine: structured outputs": "--grammar-compile-threads --max-grammar-compile-s "
    "--max-grammar-cache-bytes",
    "engine: LoRA adapters": "--enable-lora --max-loras --max-lora-rank --max-cpu-loras",
    "engine: speculative decoding": "--speculative-config",
    "parallelism": "--tensor-parallel-size --num-nodes --distributed-init-method "
    "--distributed-timeout-s --pipeline-parallel-size",
    "vLLM compatibility": "--trust-remote-code --enforce-eager --disable-log-stats "
    "--enable-chunked-prefill --quantization",
}
HELP_INDENT = " " * 24  # argparse's column of wrapped help lines


def serve_help(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> str:
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


def parse_help(text: str) -> tuple[str, list[tuple[str, str, str]]]:
    """(the description, [(group, flag, its help text)]) of argparse's help output; an entry
    is named by its first long flag (`--reflection, --no-reflection`: `--reflection`)."""
    description, _, body = text.partition("\n\noptions:\n")
    entries: list[tuple[str, str, list[str]]] = []
    group = "options"
    for line in body.splitlines():
        if header := re.fullmatch(r"(\S.*):", line):
            group = header.group(1)
        elif line.startswith("  -"):
            flags, _, first_line = line.strip().partition("  ")
            flag = re.search(r"--[\w-]+", flags)
            assert flag is not None, line
            entries.append((group, flag.group(), [first_line]))
        elif line.startswith(HELP_INDENT) and entries:
            entries[-1][2].append(line)
    return description, [(g, f, " ".join(" ".join(h).split())) for g, f, h in entries]


def test_the_description_says_it_serves_grpc_and_openai_http(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    description, _ = parse_help(serve_help(monkeypatch, capsys))
    text = " ".join(description.split())
    assert "Serve the model over gRPC" in text
    assert "with --http-port" in text and "OpenAI-compatible HTTP API" in text


def test_every_flag_is_listed_once_in_its_group(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _, entries = parse_help(serve_help(monkeypatch, capsys))
    flags = [flag for _, flag, _ in entries]
    assert len(flags) == len(set(flags)), sorted(f for f in flags if flags.count(f) > 1)
    listed: dict[str, list[str]] = {}
    for group, flag, _ in entries:
        listed.setdefault(group, []).append(flag)
    assert listed == {group: names.split() for group, names in GROUPS.items()}


def test_every_entry_says_what_the_flag_does_and_its_default(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _, entries = parse_help(serve_help(monkeypatch, capsys))
    assert len(entries) > 60
    thin = []
    for _, flag, text in entries:
        what = re.sub(r"\(?default: [^)]*\)?", " ", text)
        words = set(re.findall(r"[a-z0-9]+", what.lower())) - set(flag[2:].split("-"))
        # more than the flag's own name said again (`trust_remote_code`, `quantization`)
        if flag != "--help" and ("default:" not in text or len(words) < 3):
            thin.append((flag, text))
    assert not thin, thin
    compatibility = [(f, text) for g, f, text in entries if g == "vLLM compatibility"]
    for flag, text in compatibility:  # whether vLLM's flag does anything here, first
        assert text.startswith(("ignored:", "refused", "honoured")), (flag, text)
