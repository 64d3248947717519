-- depends: 0008.rollouts
-- A regenerated turn names the turn it answers again (`TurnReceived.regenerates`, v4), so the
-- experience builder can pair the two answers when the user keeps the second.
ALTER TABLE experience_turns ADD COLUMN regenerates UUID;
