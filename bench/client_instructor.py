"""instructor against a running basertd, outside the test suite: every instructor release pins
``jiter<0.15`` while the openai versions the suite resolves need ``jiter>=0.16``, so it runs from a
venv of its own. One pydantic model through each of instructor's ``TOOLS``, ``JSON_SCHEMA`` and
``JSON`` modes; prints each mode's object or its error.

    python3 -m venv /tmp/instr-venv
    /tmp/instr-venv/bin/pip install "instructor==1.17.0" "openai>=3.0,<3.20"
    /tmp/instr-venv/bin/python bench/client_instructor.py --base-url http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import argparse
from typing import Literal

import instructor
from openai import OpenAI
from pydantic import BaseModel, Field


class City(BaseModel):
    name: str = Field(max_length=40)
    country: Literal["France", "Germany", "Spain", "Italy"]
    population_millions: int = Field(ge=0, le=50)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default="gemma-3-270m-q4_k_m")
    ap.add_argument("--max-tokens", type=int, default=400)
    args = ap.parse_args()
    base = OpenAI(base_url=args.base_url, api_key="none", timeout=600)
    failed = 0
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA, instructor.Mode.JSON):
        client = instructor.from_openai(base, mode=mode)
        try:
            out = client.chat.completions.create(
                model=args.model,
                response_model=City,
                messages=[{"role": "user", "content": "Describe Paris as a City."}],
                max_tokens=args.max_tokens,
                temperature=0,
                max_retries=1,
            )
            print(mode.name, "ok", out.model_dump())
        except Exception as exc:  # report it and go on with the next mode
            failed += 1
            print(mode.name, "failed", type(exc).__name__, str(exc)[:300])
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
