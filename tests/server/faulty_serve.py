"""A duet process over the fake engine, for tests that need a real process (SIGTERM).

usage: python -m tests.server.faulty_serve MODELS_FILE PORT REPLY_TOKENS SHUTDOWN_TIMEOUT_S
Each generation prints how many tokens it produced when it ends, so a test can see that a
cancelled one stopped (uvicorn re-raises SIGTERM once it has shut down, so no atexit hook runs).
"""

import sys

from engines.fake import FakeEngine
from engines.memory import Estimate
from server.app import create_app
from server.cli import run_server
from server.settings import Settings


class ReportingEngine(FakeEngine):
    def ended(self, request_no, tokens):
        print(f"TOKENS {tokens}", flush=True)


class SlowFactory:
    names = ("torch", "mlx")

    def __init__(self, reply_tokens: int):
        self.reply = "z" * reply_tokens

    def available(self, name):
        return True

    def estimate(self, name, spec):
        return Estimate(0, 0, spec.context_length)

    def default_memory_budget(self):
        return 1 << 40

    def prepare(self, name):
        pass

    def create(self, name, spec, kv_cache_limit=None):
        return ReportingEngine(name, reply=self.reply, context_length=4096, token_delay_s=0.05)


def main() -> None:
    models_file, port, reply_tokens, grace = sys.argv[1:5]
    factory = SlowFactory(int(reply_tokens))
    settings = Settings(models_file=models_file, port=int(port), shutdown_timeout_s=float(grace),
                        log_level="warning")
    run_server(create_app(settings, factory), settings)


if __name__ == "__main__":
    main()
