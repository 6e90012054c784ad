"""One call as it flows through the tiers: its settings, where its rows come from (``sources``), the rows
(``rows``), its state and tallies (``state``) and where its results go (``sinks``)."""
