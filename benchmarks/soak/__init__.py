"""The canary soak: the CPU canary under steady client load, with replica kills and a numerical
fault, counting what each client got back (`python -m fuselane.benchmarks.soak.canary_soak`).

- `clients`: the requests (completions and chats, streamed and whole, greedy and sampled), the
  clients that send them, and the one outcome each answer is: ok, error, truncated or lost;
- `chaos`: what is done to the custom arm: a replica's process killed, the arm redeployed with
  a fault switched on and off again, the rollback watched;
- `report`: the figures and the results JSON (date, machine, versions, config);
- `canary_soak`: the command: Ray, the canary, the schedule, the report.

Not run in CI: it takes the minutes it is given, plus the engines' starts.
"""
