"""The policy: pure functions of a snapshot, the rule and the time (pressure, victims,
preferences, forecast, retention, system rules, rights). Nothing here touches the system: a
test imports each module in a fresh interpreter and finds nothing that acts loaded."""
