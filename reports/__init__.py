"""Reports (installed as ``vtoken.reports``): the upgrade audit (``audit``) and the vLLM runs
it makes (``vllm_runs``). Toolkit code: it may import the system and the other toolkit
folders; nothing in the system imports it."""
