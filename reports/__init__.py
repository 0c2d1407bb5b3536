"""Reports (installed as ``vtoken.reports``): the upgrade audit (``audit``) and the vLLM runs
it makes (``vllm_runs``). Toolkit code: it may import the system and the other toolkit
folders; nothing in the system imports it.

Owns: nothing (a package marker).
May call: nothing itself; its modules call the system and the other toolkit folders.
Costs: O(1).
"""
