"""What a call asks before it computes, besides the store: this process's own exact tier
(``local_exact``) and the cost model that decides which rows a map lookup pays for (``cost_model``);
and the prefix tier of causal models (``prefix``), which runs rows on their suffixes after stored prefixes."""
