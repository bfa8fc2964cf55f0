"""agentserve: a serving stack for agentic LLM workloads."""

__version__ = "0.1.0"
