"""The P:D planner (`baton planner`): watches a cluster's timings against its SLO and
changes workers' roles towards the role that holds it back (issue 41 item 3)."""
