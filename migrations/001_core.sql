-- Core tables of the ingestion pipeline (SPEC §1 "tables").

-- One row per live daemon process. The heartbeat is what orphan GC trusts:
-- a claim is only released when its owner's heartbeat is older than the lease.
CREATE TABLE workers (
    worker_id     text PRIMARY KEY,
    worker_name   text NOT NULL,
    hostname      text NOT NULL,
    pid           integer NOT NULL,
    started_at    timestamptz NOT NULL DEFAULT now(),
    heartbeat_at  timestamptz NOT NULL DEFAULT now(),
    stopped_at    timestamptz
);
CREATE INDEX workers_name_idx ON workers (worker_name);

CREATE TABLE modifications (
    id              bigserial PRIMARY KEY,
    request_id      text NOT NULL,
    request_type    text NOT NULL,
    payload         jsonb NOT NULL,
    payload_sha256  text NOT NULL,
    status          text NOT NULL CHECK (status IN ('IN_PROGRESS', 'COMPLETED')),
    sqs_message_id  text NOT NULL,
    owner           text,
    sent_at         timestamptz,
    received_at     timestamptz NOT NULL DEFAULT now(),
    completed_at    timestamptz,
    result          jsonb,
    CONSTRAINT modifications_request_id_key UNIQUE (request_id)
);
-- GC scans only the (few) rows still in progress.
CREATE INDEX modifications_in_progress_idx ON modifications (owner) WHERE status = 'IN_PROGRESS';
-- Reconciliation reads a day's window.
CREATE INDEX modifications_received_at_idx ON modifications (received_at);

-- Transient failures per request. Kept apart from the claim (which is deleted on
-- release) so that the retry limit counts only attempts that actually ran a handler,
-- not receives spent waiting for another owner.
CREATE TABLE retry_attempts (
    request_id  text PRIMARY KEY,
    failures    integer NOT NULL,
    last_error  text,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE dead_letters (
    id              bigserial PRIMARY KEY,
    sqs_message_id  text NOT NULL,
    body            text NOT NULL,      -- the raw SQS body, byte for byte
    reason          text NOT NULL,
    error           text,
    request_id      text,
    request_type    text,
    receive_count   integer,
    received_at     timestamptz NOT NULL DEFAULT now(),
    replayed_at     timestamptz,
    CONSTRAINT dead_letters_sqs_message_id_key UNIQUE (sqs_message_id)
);
CREATE INDEX dead_letters_reason_idx ON dead_letters (reason, received_at);

CREATE TABLE entities (
    entity_id   text PRIMARY KEY,
    version     bigint NOT NULL,
    deleted     boolean NOT NULL DEFAULT false,
    data        jsonb,
    request_id  text NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE reconciliation_runs (
    run_id        bigserial PRIMARY KEY,
    run_date      date NOT NULL,
    window_start  timestamptz NOT NULL,
    window_end    timestamptz NOT NULL,
    status        text NOT NULL,
    counts        jsonb,
    started_at    timestamptz NOT NULL DEFAULT now(),
    finished_at   timestamptz
);
CREATE INDEX reconciliation_runs_date_idx ON reconciliation_runs (run_date);

CREATE TABLE reconciliation_discrepancies (
    id          bigserial PRIMARY KEY,
    run_id      bigint NOT NULL REFERENCES reconciliation_runs (run_id) ON DELETE CASCADE,
    kind        text NOT NULL,
    request_id  text,
    entity_id   text,
    source      text,
    details     jsonb
);
CREATE INDEX reconciliation_discrepancies_run_idx ON reconciliation_discrepancies (run_id, kind);
