"""Load-test your own ``eventkv serve`` deployment with locust (https://locust.io).

Each simulated user is an agent with a memory of its own: it creates the memory (``locust-<random
hex>``), adds a short history, then loops over queries, adds and updates (weights 6 / 2 / 1, as an
agent that reads more than it writes) until the run ends, and deletes its memory when it stops.

    pip install locust
    eventkv serve --model smollm2-135m --store /tmp/eventkv-load &
    locust -f benchmarks/locustfile.py --host http://127.0.0.1:8000 --headless -u 8 -r 2 -t 60s --stop-timeout 30

(``--stop-timeout``: the seconds a user may take, once the run is over, to finish its request and
delete its memory.) Drop ``--headless`` for locust's web page (http://127.0.0.1:8089). Settings,
as environment variables:

| variable | default | |
|---|---|---|
| ``EVENTKV_TOKEN`` | none | the bearer token (a server with ``--token-file``) |
| ``EVENTKV_NAMESPACE`` | ``default`` | the namespace every request is scoped to |
| ``EVENTKV_EVENTS`` | 20 | events each user's memory starts with |
| ``EVENTKV_K`` | 8 | events a query serves |
| ``EVENTKV_NEW_TOKENS`` | 16 | greedy tokens a query generates |

Requests are named by their route template (``/v1/memories/[mid]/query``), so locust's table has one
row per route whatever the memory ids. A 503 (queue full, ``Retry-After``) counts as a failure here:
raise ``eventkv serve --max-queue`` or lower ``-u`` when you see them. The server batches the
queries queued together (``--max-batch``); its ``/metrics`` show the batch sizes it read out
(``eventkv_query_batch_size``).
"""

from __future__ import annotations

import os
import random
import uuid

from locust import HttpUser, between, task

PEOPLE = ("Dana", "Ravi", "Mei", "Tomas", "Aiko", "Lena", "Omar", "Priya", "Jon", "Sofia")
PLACES = ("Lisbon", "Oslo", "Kyoto", "Austin", "Nairobi", "Porto", "Quito", "Tallinn", "Hanoi", "Perth")


def setting(name: str, default: int) -> int:
    """An integer setting from the environment (``EVENTKV_<NAME>``)."""
    return int(os.environ.get(f"EVENTKV_{name}", default))


class MemoryUser(HttpUser):
    """One agent on its own memory: create it and add a history, then query, add and update."""

    wait_time = between(0.1, 0.5)

    def on_start(self) -> None:
        self.rng = random.Random()
        self.mid = f"locust-{uuid.uuid4().hex[:12]}"
        self.headers = {"X-EventKV-Namespace": os.environ.get("EVENTKV_NAMESPACE", "default")}
        if os.environ.get("EVENTKV_TOKEN"):
            self.headers["Authorization"] = f"Bearer {os.environ['EVENTKV_TOKEN']}"
        self.post("/v1/memories", {"id": self.mid, "instruction": "Answer from the events."}, "/v1/memories")
        history = [{"text": self.fact()} for _ in range(setting("EVENTS", 20))]
        r = self.post(f"/v1/memories/{self.mid}/events", {"events": history, "prefill": True}, "events")
        self.ids = [a["id"] for a in r.json()["added"]] if r.ok else []
        self.n = 0

    def on_stop(self) -> None:
        path, name = f"/v1/memories/{self.mid}", "/v1/memories/[mid]"
        with self.client.delete(path, headers=self.headers, name=name, catch_response=True) as r:
            if r.status_code == 404:  # stopped before its memory was created: nothing to delete
                r.success()

    def fact(self) -> str:
        p, q = self.rng.sample(PEOPLE, 2)
        return f"{p} told the assistant that {q} works from {self.rng.choice(PLACES)} now."

    def post(self, path: str, body: dict, name: str):
        route = name if name.startswith("/") else f"/v1/memories/[mid]/{name}"
        return self.client.post(path, json=body, headers=self.headers, name=route)

    @task(6)
    def query(self) -> None:
        body = {
            "question": f"Where does {self.rng.choice(PEOPLE)} work from?",
            "k": setting("K", 8),
            "max_new_tokens": setting("NEW_TOKENS", 16),
        }
        self.post(f"/v1/memories/{self.mid}/query", body, "query")

    @task(2)
    def add(self) -> None:
        self.n += 1
        self.post(f"/v1/memories/{self.mid}/events", {"events": [{"text": self.fact()}]}, "events")

    @task(1)
    def update(self) -> None:
        if self.ids:
            eid = self.rng.choice(self.ids)
            self.post(f"/v1/memories/{self.mid}/events/{eid}/update", {"text": self.fact()}, "events/[eid]/update")
