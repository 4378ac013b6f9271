"""Roles: how a worker's scheduler process takes requests in.

    aggregated_role.py  `Role`: the aggregated worker (`both`), each request straight to
                        the scheduler; the defaults every role starts from
    transfer_role.py    what the prefill and decode roles share: the KV manager, room
                        intake, peer loss, statistics, the first token sent with the KV
    prefill_role.py     holds a request in its bootstrap queue until the decode side has
                        sent its page indices, then sends the KV it computes
    decode_role.py      reserves pages and waits for the KV to arrive before the request
                        joins the running batch
    start.py            `start_role`: the model runner, the role, the scheduler

Every role drives the same scheduler loop, through the seam of
`baton.common.engine.seam`: hooks given when the scheduler is built, and a narrow port.
This package's root imports nothing, so no role module imports back into it.
"""
