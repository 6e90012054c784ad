"""What a call asks before it computes, besides the store: this process's own exact tier
(``local_exact``) and the cost model that decides which rows a map lookup pays for (``cost_model``)."""
