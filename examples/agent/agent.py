"""An ordinary tool-calling agent, pointed at toolquake by its base URL and nothing else.

The same five tools (tools.py) on two frameworks: the OpenAI Agents SDK (chat completions or the Responses
API) and LangGraph's ReAct agent (LangChain's ChatOpenAI, chat completions). `run_task` runs one task
(tasks.py) to its end and says what happened: the calls the tools ran, the final answer, and the exception
if the framework gave up (an agent crash).

    python examples/agent/agent.py --base-url http://127.0.0.1:8080/p/shuffled/v1 --model smollm2-135m-instruct

`tool_choice`: a small model such as the embedded SmolLM2-135M, asked with `tool_choice = "auto"`, answers
in prose and never calls a tool. The agent therefore asks for `"required"` on the first model turn only: the
Agents SDK sets it back to `"auto"` after a tool call (`Agent.reset_tool_choice`, its default), and the
LangGraph agent picks its model per turn (required until a tool result is in the conversation), so the model
can answer in text once it has the tool's result. A larger model needs neither (`--tool-choice auto`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: import the example as a package
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.agent.tasks import TASKS, Task, call_ok, fact_ok  # noqa: E402
from examples.agent.tools import Toolbox  # noqa: E402

INSTRUCTIONS = "You are a helpful assistant. Use a tool to answer, then tell the user the result."


@dataclass
class Outcome:
    """One run of one task."""

    task: str
    runner: str
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    final: str = ""
    #: the framework's exception (`Type: message`) when the run did not end with an answer
    error: str | None = None
    seconds: float = 0.0
    call_ok: bool = False
    fact_ok: bool = False

    @property
    def completed(self) -> bool:
        """The task is done: the right call ran and the run ended with an answer (the framework did not give up).
        Whether that answer carries the call's result is `fact_ok`, apart: a small model's wording often does not."""
        return self.error is None and self.call_ok

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "calls": [[n, a] for n, a in self.calls], "completed": self.completed}


async def _agents_sdk(task: Task, box: Toolbox, client: Any, model: str, api: str, tool_choice: str,
                      max_tokens: int) -> str:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    kind = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
    agent = Agent(name="assistant", instructions=INSTRUCTIONS, model=kind(model=model, openai_client=client),
                  tools=[function_tool(f) for f in box.functions()],
                  # "required" on the first turn; the SDK resets it to "auto" after a tool call (reset_tool_choice)
                  model_settings=ModelSettings(tool_choice=tool_choice, temperature=0, max_tokens=max_tokens))
    result = await Runner.run(agent, task.prompt, max_turns=3)
    return str(result.final_output or "")


async def _langgraph(task: Task, box: Toolbox, base_url: str, model: str, headers: dict[str, str],
                     tool_choice: str, max_tokens: int) -> str:
    from langchain_core.messages import ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    with warnings.catch_warnings():  # create_react_agent moved to langchain.agents; LangGraph's own still runs
        warnings.simplefilter("ignore")
        from langgraph.prebuilt import create_react_agent

    tools = [tool(f) for f in box.functions()]
    llm = ChatOpenAI(model=model, base_url=base_url, api_key="none", default_headers=headers or None, temperature=0,
                     max_tokens=max_tokens, max_retries=0, timeout=300, use_responses_api=False)
    first, later = llm.bind_tools(tools, tool_choice=tool_choice), llm.bind_tools(tools, tool_choice="auto")

    def pick(state: Any, runtime: Any) -> Any:
        # "required" until a tool result is in the conversation, then "auto" (the Agents SDK's reset_tool_choice)
        return later if any(isinstance(m, ToolMessage) for m in state["messages"]) else first

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = create_react_agent(pick, tools, prompt=INSTRUCTIONS)
    out = await graph.ainvoke({"messages": [("user", task.prompt)]}, {"recursion_limit": 6})
    content = out["messages"][-1].content
    return content if isinstance(content, str) else json.dumps(content)


async def run_task(task: Task, base_url: str, model: str, *, headers: dict[str, str] | None = None,
                   tool_choice: str = "required", max_tokens: int = 64) -> Outcome:
    """Run one task through `base_url` (an OpenAI API base URL: toolquake's `/p/<profile>/v1`, or a backend)."""
    from openai import AsyncOpenAI

    box, t0 = Toolbox(), time.monotonic()
    out = Outcome(task.id, task.runner)
    client = AsyncOpenAI(base_url=base_url, api_key="none", default_headers=headers or None, max_retries=0,
                         timeout=300)
    try:
        if task.runner == "langgraph":
            out.final = await _langgraph(task, box, base_url, model, headers or {}, tool_choice, max_tokens)
        else:
            out.final = await _agents_sdk(task, box, client, model, task.runner.split("-")[1], tool_choice,
                                          max_tokens)
    except Exception as exc:  # the framework gave up: an agent crash, reported, never raised
        out.error = f"{type(exc).__name__}: {str(exc)[:300]}"
    finally:
        await client.close()
    out.calls, out.seconds = list(box.calls), time.monotonic() - t0
    out.call_ok, out.fact_ok = call_ok(task, out.calls), fact_ok(task, out.final)
    return out


async def run_tasks(tasks: list[Task] | tuple[Task, ...], base_url: str, model: str, *, concurrency: int = 2,
                    headers: dict[str, str] | None = None, tool_choice: str = "required",
                    max_tokens: int = 64) -> list[Outcome]:
    """Every task, `concurrency` at a time, in the order given."""
    gate = asyncio.Semaphore(max(1, concurrency))

    async def one(task: Task) -> Outcome:
        async with gate:
            return await run_task(task, base_url, model, headers=headers, tool_choice=tool_choice,
                                  max_tokens=max_tokens)

    return list(await asyncio.gather(*(one(t) for t in tasks)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Run the example agent's tasks through an OpenAI-compatible base URL.")
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8080/p/shuffled/v1 (toolquake)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--task", action="append", help="only this task id (repeatable)")
    p.add_argument("--tool-choice", default="required", choices=("required", "auto"),
                   help="tool_choice of the first model turn (default required: see the module's docstring)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--json", action="store_true", help="one JSON object per task instead of a line")
    args = p.parse_args(argv)
    tasks = [t for t in TASKS if not args.task or t.id in args.task]
    outcomes = asyncio.run(run_tasks(tasks, args.base_url, args.model, concurrency=args.concurrency,
                                     tool_choice=args.tool_choice, max_tokens=args.max_tokens))
    for o in outcomes:
        print(json.dumps(o.as_dict()) if args.json else
              f"{o.task:22} {o.runner:16} {'done' if o.completed else 'crash' if o.error else 'not done':8} "
              f"{'fact' if o.fact_ok else '':4} "
              f"calls={[n for n, _ in o.calls]} {o.error or o.final[:80]!r}")
    return 0 if all(o.completed for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
