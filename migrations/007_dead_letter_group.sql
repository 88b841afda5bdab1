-- A dead letter keeps the MessageGroupId of the FIFO message it was (issue 37): `dlq
-- replay` sends it back into that group, after its group's earlier messages, instead of
-- a group of its own. NULL for a standard queue's message and for letters stored before
-- this column (replay then falls back to the request_id's group, or dlq-replay).
-- Additive: a nullable column without a default is a catalog change only (ACCESS
-- EXCLUSIVE on dead_letters for milliseconds, taken within the migrate lock_timeout);
-- a daemon of the previous release keeps inserting without it. The app role's table
-- grant covers the new column.
ALTER TABLE dead_letters ADD COLUMN group_id text;
