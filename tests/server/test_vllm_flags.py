"""`vllm serve` command lines on detent-serve (issue 22): each flag does what
it does under vLLM, or stops startup saying why."""
from __future__ import annotations

import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import time

import httpx
import pytest

from server_helpers import API_KEY, AUTH, CHAT, Server, launch, real_argv, sse_events

from detent import __version__
from detent.server.cli import engine_kwargs, parse_args


def test_model_positional_or_flag():
    assert parse_args(["some/model"]).model == "some/model"
    assert parse_args(["--model", "some/model"]).model == "some/model"
    assert parse_args(["m", "--model", "m"]).model == "m"
    assert parse_args([]).model is None
    with pytest.raises(SystemExit):
        parse_args(["a", "--model", "b"])


def test_engine_flags_reach_the_engine():
    kw = engine_kwargs(parse_args(["m", "--gpu-memory-utilization", "0.5", "--enforce-eager", "-tp", "2"]))
    assert (kw["gpu_memory_utilization"], kw["enforce_eager"], kw["tensor_parallel_size"]) == (0.5, True, 2)
    kw = engine_kwargs(parse_args([]))
    assert (kw["gpu_memory_utilization"], kw["enforce_eager"], kw["enable_prefix_caching"]) == (0.9, False, True)
    assert kw["warmup"] is None  # warm start: on for CUDA (engine/warmup.py)
    assert engine_kwargs(parse_args(["--no-warm-start"]))["warmup"] is False
    assert engine_kwargs(parse_args(["--no-enable-prefix-caching"]))["enable_prefix_caching"] is False
    assert engine_kwargs(parse_args(["--enable-prefix-caching"]))["enable_prefix_caching"] is True
    kw = engine_kwargs(parse_args(["--max-logprobs", "5", "--num-gpu-blocks-override", "64", "--kv-cache-dtype",
                                   "auto", "--enable-chunked-prefill"]))
    assert (kw["max_logprobs"], kw["num_gpu_blocks"]) == (5, 64)
    assert "max_logprobs" not in engine_kwargs(parse_args([])) and "num_gpu_blocks" not in engine_kwargs(parse_args([]))
    for bad in (["--gpu-memory-utilization", "0"], ["--gpu-memory-utilization", "1.5"], ["--max-logprobs", "-1"],
                ["--num-gpu-blocks-override", "0"], ["--kv-cache-dtype", "fp8"], ["--no-enable-chunked-prefill"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_reasoning_and_tool_parser_flags():
    a = parse_args(["--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert (a.reasoning_parser, a.enable_auto_tool_choice, a.tool_call_parser) == ("qwen3", True, "hermes")
    assert parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder"]).tool_call_parser == \
        "qwen3_coder"
    a = parse_args([])
    assert (a.reasoning_parser, a.enable_auto_tool_choice, a.tool_call_parser) == (None, False, None)
    for bad in (["--enable-auto-tool-choice"], ["--reasoning-parser", "granite"], ["--tool-call-parser", "mistral"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_log_flags():
    a = parse_args(["--uvicorn-log-level", "error", "--disable-log-stats", "--enable-log-requests"])
    assert (a.uvicorn_log_level, a.disable_log_stats, a.enable_log_requests) == ("error", True, True)
    assert parse_args([]).enable_log_requests is False


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "import sys; from detent.server.cli import main; main(sys.argv[1:])"
                           if args[0] == "serve" else "import sys; from detent.cli import main; sys.exit(main())",
                           *args[1:]], capture_output=True, text=True, timeout=120)


def test_version_on_both_commands():
    for cmd, name in (("serve", "detent-serve"), ("detent", "detent")):
        r = _run(cmd, "--version")
        assert r.returncode == 0 and r.stdout.strip() == f"{name} {__version__}", r


def test_trust_remote_code_refused():
    r = _run("serve", "some/model", "--trust-remote-code")
    assert r.returncode == 2
    assert "Detent runs no remote code" in r.stderr and "--trust-remote-code" in r.stderr


def test_chat_template_file_or_string(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert parse_args(["--chat-template", str(f)]).chat_template == f.read_text()
    assert parse_args(["--chat-template", "{{ messages[0].content }}\\n"]).chat_template == "{{ messages[0].content }}\n"
    assert parse_args(["--chat-template", "{{ 'é' }}"]).chat_template == "{{ 'é' }}"
    assert parse_args([]).chat_template is None
    for bad in ("no/such/template.jinja", "{% for %}"):
        with pytest.raises(SystemExit):
            parse_args(["--chat-template", bad])


def test_generation_config_defaults(tmp_path):
    from detent.server.generation_config import sampling_defaults

    model_dir = str(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 7, "do_sample": True, "eos_token_id": 2}))
    want = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 7}
    assert sampling_defaults("auto", model_dir) == want == sampling_defaults(str(tmp_path), None)
    assert sampling_defaults("vllm", model_dir) == {} == sampling_defaults("auto", None)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match="temperature"):
        sampling_defaults("auto", model_dir)
    with pytest.raises(ValueError, match="generation_config.json"):
        sampling_defaults(str(tmp_path / "nope"), None)
    with pytest.raises(SystemExit):
        parse_args(["--generation-config", str(tmp_path / "nope")])
    assert parse_args([]).generation_config == "auto"


def test_a_vllm_command_line_serves_and_logs_requests(tiny_model, tmp_path):
    """`vllm serve MODEL -tp 1 --gpu-memory-utilization ... --block-size 32 ... --enable-log-requests`, pasted."""
    template = "{% for m in messages %}<<{{ m.content }}>>{% endfor %}"
    argv = real_argv(tiny_model, "-tp", "1", "--gpu-memory-utilization", "0.5", "--enforce-eager", "--block-size", "32",
                     "--max-logprobs", "2", "--enable-chunked-prefill", "--kv-cache-dtype", "auto",
                     "--num-gpu-blocks-override", "40",
                     "--no-enable-prefix-caching", "--uvicorn-log-level", "warning", "--disable-log-stats",
                     "--enable-log-requests", "--max-model-len", "256", "--api-key", API_KEY,
                     "--chat-template", template, "--generation-config", str(tmp_path))
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 3}))
    with launch(argv) as s:
        auth = {"Authorization": f"Bearer {API_KEY}"}
        assert httpx.get(s.url + "/tokenizer_info", timeout=30).json()["chat_template"] == template
        chat = httpx.post(s.url + "/tokenize", headers=auth, timeout=30,
                          json={"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
        plain = httpx.post(s.url + "/tokenize", headers=auth, timeout=30,
                           json={"prompt": "<<hi>>", "add_special_tokens": False}).json()["tokens"]
        assert chat == plain
        # --generation-config: unset fields take its values, set ones win
        msgs = [{"role": "user", "content": "hello"}]
        url, body = s.url + "/v1/chat/completions", {"messages": msgs, "ignore_eos": True, "seed": 1}
        a = httpx.post(url, headers=auth, timeout=60, json=body).json()
        b = httpx.post(url, headers=auth, timeout=60, json={**body, "seed": 2}).json()
        assert a["usage"]["completion_tokens"] == 3 and a["choices"][0]["message"] == b["choices"][0]["message"]
        c = httpx.post(url, headers=auth, timeout=60, json={**body, "max_tokens": 5, "temperature": 1.0}).json()
        assert c["usage"]["completion_tokens"] == 5
        r = httpx.post(s.url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"prompt": "hello", "max_tokens": 3, "temperature": 0, "request_id": "cmpl-logme"},
                       timeout=60)
        assert r.status_code == 200, r.text
        # 40 blocks, one of them the null block: 39 x 32 tokens
        assert "KV cache 1,248 tokens in blocks of 32; maximum concurrency for 256 tokens per request: 4.88x" \
            in s.output(), s.output()[-2000:]
        info = [line for line in httpx.get(s.url + "/metrics", timeout=10).text.splitlines()
                if line.startswith("detent:cache_config_info{")]
        assert len(info) == 1 and 'num_gpu_blocks="40"' in info[0] and 'block_size="32"' in info[0], info
        over = httpx.post(s.url + "/v1/completions", headers=auth, timeout=60,
                          json={"prompt": "hello", "max_tokens": 2, "logprobs": 3})
        assert over.status_code == 400 and "max_logprobs=2" in over.text, over.text
        logged = [line for line in s.output().splitlines() if "cmpl-logme" in line]
        assert len(logged) == 1 and "INFO" in logged[0] and "max_tokens=[3]" in logged[0], s.output()[-2000:]


def test_attention_backend_flag_reaches_the_engine():
    assert engine_kwargs(parse_args([]))["attention_backend"] is None
    for name in ("fa4", "triton_paged", "FLASH_ATTN", "TRITON_ATTN"):
        assert engine_kwargs(parse_args(["--attention-backend", name]))["attention_backend"] == name
    with pytest.raises(SystemExit):
        parse_args(["--attention-backend", "FLASHINFER"])


def _config(tmp_path, text: str, name: str = "serve.yaml") -> str:
    f = tmp_path / name
    f.write_text(text)
    return str(f)


def _refused(capsys, argv: list[str]) -> str:
    """argparse's exit 2 for `argv`; its message."""
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_config_file_sets_flags_and_the_command_line_wins(tmp_path):
    """`vllm serve --config FILE.yaml`: keys are flag names, dashes or underscores."""
    cfg = _config(tmp_path, "model: some/model\nmax_model_len: 512\nmax-num-seqs: 8\nenforce-eager: true\n"
                            "enable_prefix_caching: false\ntrust-remote-code: false\ngpu-memory-utilization: 0.5\n"
                            "served-model-name: [a, b]\napi-key: -starts-with-a-dash\n"
                            "profiler-config: {profiler: torch, torch_profiler_dir: /tmp/p}\n")
    a = parse_args(["--config", cfg])
    assert (a.model, a.max_model_len, a.max_num_seqs, a.enforce_eager, a.enable_prefix_caching) == \
        ("some/model", 512, 8, True, False)
    assert (a.gpu_memory_utilization, a.served_model_name, a.api_key) == (0.5, ["a", "b"], "-starts-with-a-dash")
    assert a.profiler.dir == "/tmp/p"
    a = parse_args(["other/model", f"--config={cfg}", "--max-model-len", "256", "--enable-prefix-caching",
                    "--served-model-name", "c"])
    assert (a.model, a.max_model_len, a.enable_prefix_caching, a.served_model_name) == \
        ("other/model", 256, True, ["c"])
    assert parse_args(["--config", cfg, "--model", "third/model"]).model == "third/model"
    assert parse_args(["--config", _config(tmp_path, "", "empty.yml")]).model is None


def test_config_file_key_that_is_no_flag_refuses_startup(tmp_path, capsys):
    for text, why in (("max-modle-len: 5\n", "unknown key 'max-modle-len'"),
                      ("config: other.yaml\n", "unknown key 'config'"),
                      ("enforce-eager: 1\n", "'enforce-eager' is a switch"),
                      ("max-model-len: true\n", "'max-model-len' takes a value"),
                      ("api-key: [k1, k2]\n", "'api-key' takes one value, not a list"),
                      ("max-model-len:\n", "'max-model-len' has no value"),
                      ("max-model-len: many\n", "--max-model-len: invalid int value: 'many'"),
                      ("- max-model-len\n", "must map flag names to values"),
                      ("a: [\n", "is not valid YAML"),
                      ("trust-remote-code: true\n", "Detent runs no remote code")):
        assert why in _refused(capsys, ["--config", _config(tmp_path, text)]), text
    assert "must be YAML" in _refused(capsys, ["--config", _config(tmp_path, "{}", "serve.json")])
    assert "No such file" in _refused(capsys, ["--config", str(tmp_path / "none.yaml")])
    cfg = _config(tmp_path, "seed: 1\n")
    assert "more than once" in _refused(capsys, ["--config", cfg, "--config", cfg])
    assert "spell the flag out in full" in _refused(capsys, ["--conf", cfg])


def test_uvicorn_flags_reach_uvicorns_config():
    import uvicorn

    from detent.server.cli import uvicorn_options
    o = uvicorn_options(parse_args(["--ssl-certfile", "c.pem", "--ssl-keyfile", "k.pem", "--ssl-ca-certs", "ca.pem",
                                    "--ssl-cert-reqs", "2"]))
    assert (o["ssl_certfile"], o["ssl_keyfile"], o["ssl_ca_certs"], o["ssl_cert_reqs"]) == \
        ("c.pem", "k.pem", "ca.pem", 2)
    uvicorn.Config(None, **o)  # every key is one of uvicorn's
    o = uvicorn_options(parse_args([]))
    assert (o["ssl_certfile"], o["ssl_keyfile"], o["ssl_cert_reqs"], o["access_log"]) == (None, None, 0, True)
    # an access-log line per request at INFO, as vLLM writes; --disable-uvicorn-access-log: never
    assert uvicorn_options(parse_args(["--uvicorn-log-level", "warning"]))["log_level"] == "warning"
    assert uvicorn_options(parse_args(["--log-level", "debug", "--disable-uvicorn-access-log"]))["access_log"] is False
    for bad in (["--ssl-keyfile", "k.pem"], ["--ssl-ca-certs", "ca.pem"], ["--ssl-cert-reqs", "2"],
                ["--ssl-certfile", "c.pem", "--ssl-cert-reqs", "3"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_a_certificate_that_does_not_load_refuses_startup_before_the_model(tmp_path):
    (tmp_path / "cert.pem").write_text("not a certificate\n")
    r = _run("serve", "--model", str(tmp_path / "no-such-model"), "--ssl-certfile", str(tmp_path / "cert.pem"))
    assert r.returncode == 2 and "refusing to start: SSLError" in r.stderr, r.stderr


@pytest.mark.skipif(shutil.which("openssl") is None, reason="makes its certificate with the openssl command")
def test_ssl_flags_serve_https(tiny_model, tmp_path):
    key, cert = str(tmp_path / "key.pem"), str(tmp_path / "cert.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    s = Server(real_argv(tiny_model, "--max-model-len", "256", "--ssl-keyfile", key, "--ssl-certfile", cert))
    tls = ssl.create_default_context(cafile=cert)
    url = s.url.replace("http://", "https://")
    try:
        deadline = time.time() + 120
        while True:
            assert s.proc.poll() is None and time.time() < deadline, s.output()[-3000:]
            try:
                r = httpx.get(url + "/v1/models", verify=tls, timeout=5)
                break
            except httpx.TransportError:
                time.sleep(0.2)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == tiny_model
        with pytest.raises(httpx.TransportError):
            httpx.get(s.url + "/v1/models", timeout=5)  # plain HTTP: no answer from a TLS socket
        assert f"on {url}" in s.output()
    finally:
        assert s.stop() == 0, s.output()[-3000:]


def test_tokenizer_flag_loads_the_tokenizer_and_its_chat_template_from_another_directory(tiny_model, tmp_path):
    """`--tokenizer DIR`: the engine detokenizes, and the server tokenizes and renders chats, with
    DIR's tokenizer (a word-level one here: "t<i>" is token i); --generation-config auto still
    reads the model's directory, as vLLM's does."""
    from detent.models.tiny import write_wordlevel_tokenizer
    model, tok = tmp_path / "model", tmp_path / "tokenizer"
    model.mkdir()
    for name in ("config.json", "model.safetensors"):  # no tokenizer of its own
        (model / name).symlink_to(os.path.join(tiny_model, name))
    (model / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3}))
    write_wordlevel_tokenizer(str(tok), 49152)
    template = "{% for m in messages %}{{ m.content }} {% endfor %}"
    (tok / "chat_template.jinja").write_text(template)
    (tok / "generation_config.json").write_text(json.dumps({"max_new_tokens": 5}))
    assert engine_kwargs(parse_args([str(model), "--tokenizer", str(tok)]))["tokenizer"] == str(tok)
    with launch(real_argv(str(model), "--tokenizer", str(tok), "--max-model-len", "256")) as s:
        assert httpx.get(s.url + "/tokenizer_info", timeout=30).json()["chat_template"] == template
        r = httpx.post(s.url + "/tokenize", json={"prompt": "t7 t8", "add_special_tokens": False}, timeout=30)
        assert r.json()["tokens"] == [7, 8]
        r = httpx.post(s.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "t5 t6"}], "ignore_eos": True, "seed": 1, "temperature": 1.0})
        body = r.json()
        assert (body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]) == (2, 3), body
        words = body["choices"][0]["message"]["content"].split()
        assert len(words) == 3 and all(re.fullmatch(r"t\d+|<unk>|<s>|</s>", w) for w in words), words
    r = _run("serve", str(model), "--tokenizer", str(tmp_path / "no-such-tokenizer"))
    assert r.returncode == 2 and "refusing to start" in r.stderr and "no-such-tokenizer" in r.stderr, r.stderr[-2000:]


def test_a_vllm_config_file_serves(tiny_model, tmp_path):
    """`vllm serve --config serve.yaml --max-model-len 256 --log-level debug`, pasted: this change's
    flags from a file, in a plain install; the command line's flags win."""
    cfg = _config(tmp_path, f"""
model: {tiny_model}
max_model_len: 512
api-key: {API_KEY}
served-model-name: [tiny, tiny-alias]
root-path: /llm
allowed-origins: ["http://page.example"]
allow-credentials: true
return-tokens-as-token-ids: true
enable-force-include-usage: true
enable-log-requests: true
max-log-len: 4
disable-uvicorn-access-log: true
disable-fastapi-docs: true
enable-prefix-caching: false
""")
    with launch(real_argv("--config", cfg, "--max-model-len", "256", "--log-level", "debug")) as s:
        models = httpx.get(s.url + "/llm/v1/models", headers=AUTH, timeout=30).json()["data"]
        assert [m["id"] for m in models] == ["tiny", "tiny-alias"] and models[0]["max_model_len"] == 256
        assert httpx.get(s.url + "/llm/v1/models", timeout=30).status_code == 401
        r = httpx.options(s.url + "/llm/v1/chat/completions", timeout=30, headers={
            "Origin": "http://page.example", "Access-Control-Request-Method": "POST"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://page.example"
        assert r.headers["access-control-allow-credentials"] == "true"
        assert httpx.get(s.url + "/openapi.json", timeout=30).status_code == 404
        body = {**CHAT, "stream": True, "logprobs": True, "top_logprobs": 1, "ignore_eos": True}
        events = sse_events(httpx.post(s.url + "/llm/v1/chat/completions", headers=AUTH, json=body, timeout=60))
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 2
        assert all(e["usage"] is not None for e in events)
        tokens = [t["token"] for e in events[:-1]
                  for t in ((e["choices"][0].get("logprobs") or {}).get("content") or [])]
        assert len(tokens) == 2 and all(t.startswith("token_id:") for t in tokens), tokens
        r = httpx.post(s.url + "/v1/completions", headers=AUTH, timeout=60,
                       json={"prompt": "one two three four five six", "max_tokens": 1, "request_id": "cfg"})
        assert r.status_code == 200, r.text
        out = s.output()
        line = next((ln for ln in out.splitlines() if "request cfg-0 details:" in ln), out[-3000:])
        assert re.search(r"DEBUG detent\.server\.requests: request cfg-0 details: prompt: 'one ', "
                         r"prompt_token_ids: \[\d+, \d+, \d+, \d+\]$", line), line
        assert 'HTTP/1.1" ' not in out  # uvicorn's access log, at debug but for the flag
        info = [ln for ln in httpx.get(s.url + "/metrics", timeout=10).text.splitlines()
                if ln.startswith("detent:cache_config_info{")]
        assert 'enable_prefix_caching="False"' in info[0], info
