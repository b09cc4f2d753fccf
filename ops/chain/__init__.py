"""The chain of checks and its runner: what health, recover and provision share.

- checks.py: THE chain, one ordered list of checks (probe, remedy, needs);
- runner.py: runs it over one CT (health probes; recover and provision repair in order);
- report.py: the vocabulary of results (statuses, Outcome, CheckResult, ChainReport, Mode);
- lock.py: the host lock, one repair at a time per host; last_recover.py: each run's record;
- output.py: how runs are shown to people (a live line, plain lines, tables);
- deploy.py, stage_model.py: what the engine and staging checks do in a CT;
- setup.py (what only provision sets up on the host), install.py (ddops itself on the host).
"""
