#!/usr/bin/env python3
"""Check that popular OpenAI client libraries work against a live duet server.

Each client library gets a virtual environment of its own under --venv: installed together,
pip backtracks to releases a year old to satisfy their conflicting pins, so each is checked
at the newest release it installs alone. Every check is a small script run with that
environment's python against a recording proxy in front of duet; when one fails, the report
shows the client's error and the request behind it with duet's answer. Prints a table and,
unless --only is given, writes docs/clients.md.

  python scripts/check_clients.py                     # starts duet on port 8765 itself
  python scripts/check_clients.py --url http://127.0.0.1:8000 --only openai litellm

Clients run offline (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE); lm-eval reads its two tiny tasks
from scripts/client_tasks/ and tokenizes through duet's /tokenize and /detokenize
(tokenizer_backend=remote) rather than a Hugging Face tokenizer.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import http.server
import json
import os
import shlex
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "scripts" / "client_tasks"
MODEL = "smollm2-135m-instruct"

# client -> (pip requirement, distribution whose version is reported)
CLIENTS = {
    "openai": ("openai", "openai"),
    "langchain-openai": ("langchain-openai", "langchain-openai"),
    "instructor": ("instructor", "instructor"),
    "pydantic-ai": ("pydantic-ai-slim[openai]", "pydantic-ai-slim"),
    "openai-agents": ("openai-agents", "openai-agents"),
    # litellm imports mcp in every completion() with tools (ModuleNotFoundError without it)
    "litellm": ("litellm[mcp]", "litellm"),
    "lm-eval": ("lm-eval[api]", "lm_eval"),
}

# Around every check's body: the server's address, prompts, a model to extract, a tool, clients.
PRELUDE = '''
import json, os, sys, traceback
URL = os.environ["DUET_URL"]; V1 = URL + "/v1"; MODEL = os.environ["DUET_MODEL"]
TEXT = "Extract the person: John Smith is 30 years old."
# The request as one writes it where only JSON's syntax is enforced (json_object): the keys named
# in the prompt, not left to a schema shown in the system message (see LIMITS).
KEYED_TEXT = "Answer in JSON with the keys name and age. " + TEXT
ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_Q = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather",
           "description": "Get the current weather in a city", "parameters": {"type": "object",
           "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
try:
    from pydantic import BaseModel
    class Person(BaseModel):
        name: str
        age: int
except ImportError:  # lm-eval's environment
    pass
def openai_client():
    from openai import OpenAI
    return OpenAI(base_url=V1, api_key="x")
def chat_openai(max_tokens=64):
    from langchain_openai import ChatOpenAI
    return ChatOpenAI(base_url=V1, api_key="x", model=MODEL, temperature=0, max_tokens=max_tokens)
def pydantic_ai_model():
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    return OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=V1, api_key="x"))
def check():
CHECK_BODY
try:
    print("RESULT:", check())
except BaseException as e:
    traceback.print_exc()
    # skip markup (instructor wraps its retries in <tags>); a validation error's lines name fields
    lines = [l.strip() for l in str(e).splitlines()
             if l.strip() and not l.strip().startswith(("<", "For further"))]
    keep = 5 if "validation error" in str(e) else 1
    print("ERROR:", type(e).__name__ + ": " + " ".join(lines[:keep]))
    sys.exit(1)
'''

LM_EVAL = '''
import glob, subprocess, tempfile
out = tempfile.mkdtemp()
args = ["--model", "local-completions", "--model_args",
        f"model={MODEL},base_url={V1}/completions,num_concurrent=1,max_retries=1,"
        "tokenized_requests=True,tokenizer_backend=remote",
        "--tasks", TASK, "--include_path", ".", "--batch_size", "4", "--output_path", out]
p = subprocess.run([os.path.join(os.path.dirname(sys.executable), "lm_eval")] + args,
                   capture_output=True, text=True, timeout=280)
sys.stderr.write(p.stdout[-3000:] + p.stderr[-6000:])
if p.returncode:
    errors = [l for l in p.stderr.splitlines() if "Error" in l or "failed" in l]
    raise RuntimeError((errors or ["exit %d" % p.returncode])[-1].strip()[:300])
res = json.load(open(glob.glob(out + "/**/results_*.json", recursive=True)[0]))["results"][TASK]
return ", ".join(f"{k.split(',')[0]} {v:.2f}" for k, v in res.items()
                 if isinstance(v, float) and "stderr" not in k) + " on 4 docs"
'''

AGENTS_TOOL = '''
from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool
from agents import set_default_openai_api, set_default_openai_client, set_tracing_disabled
from openai import AsyncOpenAI
set_tracing_disabled(True)
calls = []
@function_tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    calls.append(city)
    return "sunny, 22 C"
'''

# (client, what is tried, body of check(): returns a short description of what came back)
CHECKS = [
    ("openai", "chat.completions.create", '''
r = openai_client().chat.completions.create(model=MODEL, messages=ASK, temperature=0,
    max_tokens=32)
assert r.choices[0].message.content
return repr(r.choices[0].message.content[:60])'''),
    ("openai", "chat stream (include_usage)", '''
chunks = list(openai_client().chat.completions.create(model=MODEL, messages=ASK, temperature=0,
    max_tokens=32, stream=True, stream_options={"include_usage": True}))
text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
assert text and chunks[-1].usage, "no text or no usage chunk"
return f"{len(chunks)} chunks, {text[:40]!r}"'''),
    ("openai", "tools, tool_choice=required", '''
r = openai_client().chat.completions.create(model=MODEL, messages=WEATHER_Q, temperature=0,
    max_tokens=64, tools=[WEATHER], tool_choice="required")
call = r.choices[0].message.tool_calls[0].function
assert call.name == "get_weather", call
return f"{call.name}({call.arguments})"'''),
    ("openai", "chat.completions.parse(response_format=Person)", '''
r = openai_client().chat.completions.parse(model=MODEL, temperature=0, max_tokens=64,
    response_format=Person, messages=[{"role": "user", "content": TEXT}])
assert isinstance(r.choices[0].message.parsed, Person)
return repr(r.choices[0].message.parsed)'''),
    ("openai", "responses.create, plain and stream=True", '''
client = openai_client()
r = client.responses.create(model=MODEL, input=ASK[0]["content"], temperature=0,
    max_output_tokens=32)
events = list(client.responses.create(model=MODEL, input=ASK[0]["content"], temperature=0,
    max_output_tokens=32, stream=True))
text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
assert r.output_text and text == r.output_text, (r.output_text, text)
assert events[-1].type == "response." + r.status, events[-1].type
return f"{r.status}, {len(events)} events, {r.output_text[:40]!r}"'''),
    ("openai", "logprobs=True, top_logprobs=3", '''
r = openai_client().chat.completions.create(model=MODEL, messages=ASK, temperature=0,
    max_tokens=8, logprobs=True, top_logprobs=3)
lp = r.choices[0].logprobs.content
assert lp and len(lp[0].top_logprobs) == 3
return f"{len(lp)} tokens, first {lp[0].token!r} {lp[0].logprob:.3f}"'''),
    ("langchain-openai", "ChatOpenAI.invoke", '''
m = chat_openai(32).invoke("What is the capital of France?")
assert m.content
return repr(m.content[:60])'''),
    ("langchain-openai", "ChatOpenAI.batch (4 prompts)", '''
out = chat_openai(24).batch([f"What is the capital of {c}?"
                             for c in ("France", "Italy", "Spain", "Peru")])
assert len(out) == 4 and all(m.content for m in out)
return " | ".join(m.content[:25] for m in out)'''),
    ("langchain-openai", "bind_tools(tool_choice='get_weather')", '''
llm = chat_openai().bind_tools([WEATHER], tool_choice="get_weather")
m = llm.invoke("What is the weather in Paris?")
assert m.tool_calls and m.tool_calls[0]["name"] == "get_weather", m
return str(m.tool_calls[0]["args"])'''),
    *(("langchain-openai", f"with_structured_output(Person, method='{method}')", '''
p = chat_openai().with_structured_output(Person, method="__METHOD__").invoke(KEYED_TEXT)
assert isinstance(p, Person), p
return repr(p)'''.replace("__METHOD__", method)) for method in ("function_calling", "json_schema",
                                                            "json_mode")),
    *(("instructor", f"from_openai(mode=Mode.{mode})", '''
import instructor
client = instructor.from_openai(openai_client(), mode=instructor.Mode.__MODE__)
return repr(client.chat.completions.create(model=MODEL, response_model=Person, max_retries=1,
    temperature=0, max_tokens=64, messages=[{"role": "user", "content": KEYED_TEXT}]))'''
       .replace("__MODE__", mode)) for mode in ("JSON", "JSON_SCHEMA", "TOOLS")),
    ("pydantic-ai", "Agent(output_type=Person).run_sync", '''
from pydantic_ai import Agent
agent = Agent(pydantic_ai_model(), output_type=Person,
              model_settings={"temperature": 0, "max_tokens": 64})
return repr(agent.run_sync(TEXT).output)'''),
    ("pydantic-ai", "Agent + @agent.tool_plain (tool_choice auto)", '''
from pydantic_ai import Agent
agent = Agent(pydantic_ai_model(), model_settings={"temperature": 0, "max_tokens": 64})
calls = []
@agent.tool_plain
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    calls.append(city)
    return "sunny, 22 C"
out = agent.run_sync("What is the weather in Paris? Use the get_weather tool.").output
return f"tool called with {calls}; {out[:40]!r}" if calls else f"tool not called; {out[:40]!r}"'''),
    ("openai-agents", "Runner.run_sync, default model (Responses API)", AGENTS_TOOL + '''
# The SDK's defaults: the Responses API, the tool offered (tool_choice auto). An answer cut by
# max_tokens (status incomplete) is an error to the SDK: ask what the model answers briefly.
set_default_openai_client(AsyncOpenAI(base_url=V1, api_key="x"), use_for_tracing=False)
set_default_openai_api("responses")
agent = Agent(name="a", model=MODEL, tools=[get_weather],
              model_settings=ModelSettings(temperature=0, max_tokens=64))
return repr(Runner.run_sync(agent, "What is the capital of France?", max_turns=3).final_output)'''),
    ("openai-agents", "Runner.run_streamed, default model (Responses API), tool forced once",
     AGENTS_TOOL + '''
# Streamed Responses events: the forced call's function_call item, then (tool_choice reset to
# auto) the answer to the call's output, which goes back whole in the next request's input.
import asyncio
set_default_openai_client(AsyncOpenAI(base_url=V1, api_key="x"), use_for_tracing=False)
set_default_openai_api("responses")
agent = Agent(name="a", model=MODEL, tools=[get_weather],
              model_settings=ModelSettings(temperature=0, max_tokens=64, tool_choice="required"))
async def run():
    result = Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=3)
    kinds = set()
    async for event in result.stream_events():
        if event.type == "raw_response_event":
            kinds.add(event.data.type)
    return result.final_output, kinds
out, kinds = asyncio.run(run())
assert calls and out and "response.function_call_arguments.done" in kinds, (calls, out, kinds)
return f"tool called with {calls}; then {out[:40]!r}; {len(kinds)} kinds of event"'''),
    ("openai-agents", "Runner.run_sync, OpenAIChatCompletionsModel, tool forced once",
     AGENTS_TOOL + '''
# tool_choice=required on the first turn only: reset_tool_choice (the default) then sets auto
client = AsyncOpenAI(base_url=V1, api_key="x")
agent = Agent(name="a", model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
              tools=[get_weather],
              model_settings=ModelSettings(temperature=0, max_tokens=64, tool_choice="required"))
out = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3).final_output
assert calls and out, (calls, out)
return f"tool called with {calls}; then {out[:40]!r}"'''),
    ("litellm", "completion(model='openai/...')", '''
import litellm
r = litellm.completion(model="openai/" + MODEL, api_base=V1, api_key="x", messages=ASK,
                       temperature=0, max_tokens=32)
assert r.choices[0].message.content
return repr(r.choices[0].message.content[:60])'''),
    ("litellm", "completion(tools, tool_choice=required)", '''
import litellm
r = litellm.completion(model="openai/" + MODEL, api_base=V1, api_key="x", messages=WEATHER_Q,
                       temperature=0, max_tokens=64, tools=[WEATHER], tool_choice="required")
call = r.choices[0].message.tool_calls[0].function
assert call.name == "get_weather", call
return f"{call.name}({call.arguments})"'''),
    ("lm-eval", "local-completions, generate_until task (4 docs)",
     'TASK = "duet_capitals_gen"' + LM_EVAL),
    ("lm-eval", "local-completions, multiple_choice task (loglikelihood)",
     'TASK = "duet_capitals_mc"' + LM_EVAL),
]

# Checks that fail until duet grows the feature they need.
EXPECTED: dict[str, str] = {}

LIMITS = """\
What fails is the model, not the protocol. A 135M model seldom decides by itself to call a tool:
with `tool_choice` "auto" (pydantic-ai's and openai-agents' default) it answers in text, so
agents call tools only when the call is forced (`"required"` or a named function), where duet's
grammar makes the call and its arguments valid; handed the tool's result, it often echoes the
result's format instead of answering. Through the Responses API, openai-agents treats an answer
cut by `max_output_tokens` (status `incomplete`) as an error, as it does against OpenAI; asked
about the weather with the tool left to it, the model rambles past 64 tokens, so the check with
the SDK's default settings asks for a capital instead. JSON follows the schema whenever one is
sent (`response_format` json_schema, a forced tool); with `json_object` alone (instructor's JSON
mode, langchain's json_mode) only the syntax is enforced, and the model, shown a schema in the
prompt, may copy the schema instead of filling it in: asked only "Extract the person: John
Smith is 30 years old.", instructor's JSON mode gets `{"properties": {"name": "John Smith",
"age": 30}, "required": [...` and strings listed until `max_tokens` (with `max_tokens` 200 and
`max_retries=3` the same), so the JSON-mode checks (instructor's three modes and langchain's)
name the keys in the prompt, as one does where only the syntax is enforced. Its free
answers seldom match a reference exactly (it answers "Q: ...? A:" with a whole sentence), so
generation scores in lm-eval are low, while log-likelihood scoring of fixed choices fares
better. These checks test the plumbing, not the quality."""

INTRO = """\
Each library is installed alone into a virtual environment of its own (so it gets its newest
release) and run against a live server, at temperature 0 with small `max_tokens`. A check passes
when the call returns what the library promises (text, a parsed tool call, a validated pydantic
object, an eval score); the last column shows what came back, or the first line of the error.
litellm is installed with its `mcp` extra: it imports `mcp` in every `completion()` with `tools`.
lm-eval runs `local-completions` with `tokenizer_backend=remote` (duet's `/tokenizer_info`,
`/tokenize` and `/detokenize`, so no Hugging Face tokenizer) and `tokenized_requests=True`
(prompts go as token ids), batch size 4, on two four-question tasks in `scripts/client_tasks/`."""


class Proxy(http.server.ThreadingHTTPServer):
    """Relays every request to duet and keeps each exchange, so a failure can show its request."""

    daemon_threads = True

    def __init__(self, upstream: str):
        super().__init__(("127.0.0.1", 0), _Relay)
        self.upstream = urllib.parse.urlsplit(upstream)
        self.exchanges: list[dict] = []
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


class _Relay(http.server.BaseHTTPRequestHandler):
    # HTTP/1.0: the response ends when the connection closes, so streams relay unbuffered
    def relay(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        up = self.server.upstream
        conn = http.client.HTTPConnection(up.hostname, up.port or 80, timeout=900)
        skip = {"host", "connection", "content-length", "accept-encoding", "transfer-encoding"}
        conn.request(self.command, up.path.rstrip("/") + self.path, body=body or None,
                     headers={k: v for k, v in self.headers.items() if k.lower() not in skip})
        resp = conn.getresponse()
        self.send_response_only(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in skip | {"date", "server"}:
                self.send_header(k, v)
        self.end_headers()
        kept = b""
        while chunk := resp.read1(65536):
            self.wfile.write(chunk)
            self.wfile.flush()
            kept += chunk[:65536 - len(kept)]
        self.server.exchanges.append({"method": self.command, "path": self.path,
                                      "request": body.decode(errors="replace"),
                                      "status": resp.status,
                                      "response": kept.decode(errors="replace")})

    do_GET = do_POST = do_PUT = do_DELETE = relay

    def log_message(self, *args):
        pass


def brief(value, width=48):
    """A JSON value shortened to what identifies it: long strings and lists are cut."""
    if isinstance(value, dict):
        return {k: brief(v, width) for k, v in value.items()}
    if isinstance(value, list):
        return [brief(v, width) for v in value[:3]] + (["..."] if len(value) > 3 else [])
    if isinstance(value, str) and len(value) > width:
        return value[:width] + "..."
    return value


def describe(x: dict) -> tuple[str, str]:
    """(the request, duet's answer): an error's status, code and message, or the message given."""
    try:
        request = json.dumps(brief(json.loads(x["request"])), ensure_ascii=False)
    except ValueError:
        request = x["request"][:300]
    request = f'{x["method"]} {x["path"]} {request}'
    try:
        answer = json.loads(x["response"])
        if x["status"] >= 400:
            e = answer["error"]
            param = f' (param {e["param"]})' if e.get("param") else ""
            return request, f'{x["status"]} {e.get("code") or e.get("type")}: {e["message"]}{param}'
        if answer.get("object") == "response":  # the Responses API's
            return request, (f'{x["status"]}, {answer["status"]}, output '
                             f'{json.dumps(brief(answer["output"], 200))}')
        message = {k: v for k, v in answer["choices"][0]["message"].items() if v is not None}
        return request, f'{x["status"]}, message {json.dumps(brief(message, 200))}'
    except (ValueError, KeyError, TypeError, IndexError):
        return request, f'{x["status"]}: {x["response"][:200]}'


def setup_venv(base: Path, client: str) -> tuple[Path, str]:
    """The client's python (installing the client on first use) and the client's version."""
    spec, dist = CLIENTS[client]
    venv, python = base / client, base / client / "bin" / "python"
    stamp = venv / ".duet-installed"
    if not (stamp.exists() and stamp.read_text() == spec):
        print(f"installing {spec} into {venv} ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        spec], check=True)
        stamp.write_text(spec)
    code = f"import importlib.metadata as m; print(m.version({dist!r}))"
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=False)
    return python, out.stdout.strip() or "?"


def wait_health(url: str, timeout: float, proc=None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (proc is None or proc.poll() is None):
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                return
        except OSError:
            time.sleep(2)
    sys.exit(f"{url}/health did not answer within {timeout:.0f} s")


def run_check(python: Path, body: str, env: dict, timeout: float) -> tuple[bool, str, str]:
    code = PRELUDE.replace("CHECK_BODY", textwrap.indent(textwrap.dedent(body).strip(), "    "))
    try:
        p = subprocess.run([str(python), "-c", code], capture_output=True, text=True,
                           env=env, timeout=timeout, cwd=TASKS, check=False)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout:.0f} s", ""
    lines = p.stdout.splitlines()
    result = next((line[8:] for line in lines if line.startswith("RESULT: ")), "")
    error = next((line[7:] for line in lines if line.startswith("ERROR: ")), "")
    if p.returncode and not error:
        error = (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]
    return p.returncode == 0, result if p.returncode == 0 else error, p.stderr


def verdict(row: dict) -> str:
    if row["ok"]:
        return "pass"
    if row["what"] in EXPECTED:
        return f"FAIL (expected: {EXPECTED[row['what']]})"
    # every request answered 200: the client refused what came back
    return "FAIL (after HTTP 200)" if row["http"] and row["http"]["status"] < 400 else "FAIL"


def cell(text: str, width: int = 160) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= width else text[:width - 3] + "..."


def write_doc(path: Path, rows: list[dict], command: str) -> None:
    date = datetime.date.today().isoformat()
    lines = ["# Client libraries against duet", "",
             f"Checked on {date} against the default model ({MODEL}) on a 2-core CPU, with:",
             "", "```sh", command, "```", "", INTRO, "",
             "| client | version | what was tried | result | what came back, or the error |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['client']} | {r['version']} | {cell(r['what'])} | {verdict(r)} | "
              f"{cell(r['detail'])} |" for r in rows]
    failed = [r for r in rows if not r["ok"]]
    if failed:
        lines += ["", "## Failures", "", ("The last request of each failed check, as the client "
                  "sent it (long values cut), and duet's answer:"), ""]
        for r in failed:
            lines.append(f"- **{r['client']}: {r['what']}**: {r['detail']}")
            if r["http"]:
                request, answer = describe(r["http"])
                lines += [f"  - request: `{request}`", f"  - duet: `{answer}`"]
    lines += ["", "## What a 135M model cannot do well", "", LIMITS, ""]
    path.write_text("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running duet server (default: start one on port 8765)")
    parser.add_argument("--venv", type=Path, default=Path.home() / ".cache/duet/clients-venv",
                        help="folder of the clients' virtual environments, one per client")
    parser.add_argument("--only", nargs="+", choices=list(CLIENTS), metavar="NAME",
                        help=f"check only these ({', '.join(CLIENTS)}); leaves docs/ alone")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per check")
    args = parser.parse_args()
    clients = args.only or list(CLIENTS)
    pythons = {c: setup_venv(args.venv, c) for c in clients}

    server = None
    url = (args.url or "http://127.0.0.1:8765").rstrip("/")
    if not args.url:
        log = Path(tempfile.gettempdir()) / "duet-check-clients.log"
        print(f"starting duet on {url} (log: {log})", flush=True)
        with log.open("w") as out:
            server = subprocess.Popen([str(ROOT / ".venv/bin/duet"), "serve", "--port", "8765"],
                                      cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    rows = []
    try:
        wait_health(url, 600 if server else 30, server)
        proxy = Proxy(url)
        env = dict(os.environ, DUET_URL=proxy.url, DUET_MODEL=MODEL, OPENAI_API_KEY="x",
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                   LITELLM_LOCAL_MODEL_COST_MAP="True", OPENAI_AGENTS_DISABLE_TRACING="1",
                   PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        for client, what, body in CHECKS:
            if client not in clients:
                continue
            seen, start = len(proxy.exchanges), time.monotonic()
            ok, detail, stderr = run_check(pythons[client][0], body, env, args.timeout)
            # the failure's cause: its last error answer, else its last exchange (a 200 it refused)
            mine = proxy.exchanges[seen:]
            cause = ([x for x in mine if x["status"] >= 400] or mine or [None])[-1]
            rows.append({"client": client, "version": pythons[client][1], "what": what,
                         "ok": ok, "detail": detail, "http": None if ok else cause})
            print(f"{verdict(rows[-1])} {time.monotonic() - start:.0f}s  {client}: {what}\n"
                  f"    {detail}", flush=True)
            if not ok:
                print(textwrap.indent(stderr.strip()[-1500:], "    | "))
                if cause:
                    print("    request: {}\n    duet:    {}".format(*describe(cause)))
    finally:
        if server:
            server.terminate()
            server.wait(30)

    print(f"\n{'client':17} {'version':9} {'result':34} what was tried")
    for r in rows:
        print(f"{r['client']:17} {r['version']:9} {verdict(r):34} {r['what']}")
    if not args.only:
        command = " ".join(["python scripts/check_clients.py", *map(shlex.quote, sys.argv[1:])])
        write_doc(ROOT / "docs" / "clients.md", rows, command)
        print("wrote docs/clients.md")
    return 0 if all(r["ok"] or r["what"] in EXPECTED for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
