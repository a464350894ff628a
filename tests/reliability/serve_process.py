"""A real `helmc serve` process for the reliability tests: started on a copy of a tiny bundle (with a chat
template of the test's choosing), its stderr in a file the test reads, stopped with SIGTERM."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# ChatML, reading tool calls as the common templates do
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
          "{% for t in m.tool_calls or [] %}<tool_call>{{ t.function.name }} {{ t.function.arguments | tojson }}"
          "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def bundle_with_template(src: str, dst: str, template: str) -> str:
    """A copy of bundle `src` (unsigned) at `dst` whose chat template (chat_template.jinja) is `template`, listed
    in its manifest as the build lists files (the model's own files are data the bundle carries)."""
    import hashlib
    shutil.copytree(src, dst)
    files = {"chat_template.jinja": template, "tokenizer_config.json": json.dumps({"eos_token": "<|endoftext|>"})}
    for name, text in files.items():
        with open(os.path.join(dst, name), "w") as f:
            f.write(text)
    path = os.path.join(dst, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    manifest["files"] = [e for e in manifest["files"] if e["path"] not in files] + [
        {"path": name, "sha256": hashlib.sha256(text.encode()).hexdigest(), "size": len(text.encode())}
        for name, text in files.items()]
    with open(path, "w") as f:
        json.dump(manifest, f, indent=1)
    return dst


class Server:
    def __init__(self, bundle: str, log_path, *args, env=None):
        self.log_path = str(log_path)
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "helmc.cli.main", "serve", bundle, "--port", "0", *args],
                                     env={**os.environ, "PYTHONPATH": ROOT, **(env or {})}, stderr=self.log,
                                     stdout=subprocess.DEVNULL)
        t0 = time.time()
        while "listening on" not in self.text():
            assert self.proc.poll() is None, f"helmc serve exited before listening: {self.text()}"
            assert time.time() - t0 < 180, "helmc serve did not start in 180 s"
            time.sleep(0.2)
        self.url = self.text().split("listening on ")[1].split(" ")[0]

    def text(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def stop(self, timeout: float = 30) -> float:
        """SIGTERM; seconds until the process was gone."""
        t0 = time.time()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=timeout)
        self.log.close()
        return time.time() - t0


def http():
    """The HTTP package the installed openai client is built on (httpx, or httpx2 in its newer releases)."""
    try:
        import httpx2
        return httpx2
    except ImportError:
        import httpx
        return httpx
