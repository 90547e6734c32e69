"""Shared, expensive fixtures: the bundled GGUF and its transformers reference model/tokenizer."""

import os

# One OpenMP thread per process: the suite runs engines, servers and references side by side on
# two cores, and oversubscribed OpenMP threads slow small matmuls down by orders of magnitude.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Engines run eagerly unless a test asks for compiled regions (tests/test_compiled.py): a compile costs
# tens of seconds per process here, and the float32 oracle runs eagerly anyway.
os.environ.setdefault("KVSERVE_ENFORCE_EAGER", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Off CUDA the Triton kernels run interpreted (tests/test_triton_kernels.py). Triton reads the flag when
# it defines a function, its own library included, and any test module importing torch._dynamo
# imports triton: it is set here, before the first test module is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session")
def bundled_model_path() -> str:
    """Absolute path of the bundled SmolLM2-135M-Instruct GGUF (`make test` installs it)."""
    from kvserve.model.loader import resolve_model_path

    return resolve_model_path(None)


@pytest.fixture(scope="session")
def hf_model(bundled_model_path):
    """transformers' LlamaForCausalLM loaded from the bundled GGUF in float32 (loaded once)."""
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(bundled_model_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer(bundled_model_path):
    """transformers' tokenizer built from the bundled GGUF (loaded once)."""
    from transformers import AutoTokenizer

    folder, name = os.path.split(bundled_model_path)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="session")
def llm():
    """kvserve on the bundled model with a small paged pool (shared by tests; leaves it idle)."""
    from kvserve import LLM

    return LLM(kv_cache_memory="128MiB", max_model_len=2048, dtype="float32")


@pytest.fixture
def poisoned(llm, monkeypatch):
    """`llm` whose sampler gets NaN logits for requests seeded 1000 + k at output token k."""
    from helpers import PoisonedSampler

    monkeypatch.setattr(llm.engine, "sampler", PoisonedSampler(llm.engine.sampler))
    return llm


@pytest.fixture(scope="session")
def llm_nocache():
    """The oracle: the same model recomputing the whole sequence at every step."""
    from kvserve import LLM

    return LLM(kv_cache_mode="none", max_model_len=2048, dtype="float32")


class RedisServer:
    """A private redis-server on a free port of `host` (loopback by default), no persistence, in a
    temporary directory."""

    def __init__(self, workdir, *extra: str, port: int | None = None, host: str = "127.0.0.1"):
        import shutil
        import socket
        import subprocess

        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server is not installed: `make install` installs it "
                        "(apt-get install -y redis-server)")
        if port is None:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.port, self.host = port, host
        self.url = f"redis://{host}:{port}/0"
        self.proc = subprocess.Popen(
            [exe, "--bind", host, "--port", str(port), "--dir", str(workdir), "--save", "",
             "--appendonly", "no", "--protected-mode", "no", *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ready()

    def _wait_ready(self, timeout: float = 10.0) -> None:
        import time

        import redis

        client = redis.Redis(host=self.host, port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + timeout
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {self.port} did not start")
                time.sleep(0.05)
            finally:
                client.close()

    def stop(self) -> None:
        """Terminate the server (abruptly: SIGKILL, as a crash would) and wait for it."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture
def redis_server(tmp_path):
    """A private redis-server for one test (stopped afterwards); `.url`, `.port`, `.stop()`."""
    server = RedisServer(tmp_path)
    yield server
    server.stop()


@pytest.fixture
def make_redis(tmp_path):
    """Factory for private redis-servers: make_redis(*args, port=None); all stopped afterwards."""
    servers = []

    def make(*extra: str, port: int | None = None) -> RedisServer:
        servers.append(RedisServer(tmp_path, *extra, port=port))
        return servers[-1]

    yield make
    for s in servers:
        s.stop()
