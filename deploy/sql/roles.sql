-- Database roles for sqs-ingest. Run as a superuser (or a role with CREATEROLE that
-- owns the database), connected to the target database, BEFORE the first migration and
-- again AFTER every `sqs-ingest migrate` that adds a table (its grants are per table):
--
--   PGOPTIONS="-c sqs_ingest.owner_password=$(scripts/scram-verifier.py < owner.pw) \
--              -c sqs_ingest.app_password=$(scripts/scram-verifier.py < app.pw) \
--              -c sqs_ingest.reconcile_password=$(scripts/scram-verifier.py < reconcile.pw)" \
--     psql -v ON_ERROR_STOP=1 -d ingest -f deploy/sql/roles.sql
--
-- Three roles (README "Security": what each may do and why):
--   sqs_ingest_owner      runs `sqs-ingest migrate`: owns the tables, the only one with DDL.
--   sqs_ingest_app        the daemon, `gc`, `prune`, `dlq`: rows of its own tables only,
--                         table by table below; SELECT alone on ingest_schema_migrations
--                         (the schema check); nothing on any other table of the database.
--   sqs_ingest_reconcile  the reconcile job: SELECT on what it compares, writes only its
--                         results (reconciliation_runs / reconciliation_discrepancies).
-- No default privileges: a table the owner creates is granted here, by name, or to nobody.
-- A daemon newer than its grants reports `db_privilege` (exit 2, README Troubleshooting).
--
-- Plain SQL (no psql meta-commands) so any client can apply it. Idempotent: every
-- statement may run again; each run re-asserts exactly the grants below (revoking
-- anything else these roles were given on tables of the schema).
-- Passwords are optional settings read from the session (PGOPTIONS as above, or
-- `SET sqs_ingest.app_password = '...'` first); unset means "leave the password alone"
-- (for IAM/certificate auth, or passwords managed elsewhere). Each is a SCRAM-SHA-256
-- verifier (`SCRAM-SHA-256$4096:salt$StoredKey:ServerKey`, made by scripts/scram-verifier.py
-- from the password on its stdin), never the cleartext: PostgreSQL stores a verifier as it
-- is, so the password reaches neither the server, its logs nor an error's context. A value
-- that is not a verifier is refused without being echoed.

-- ---------------------------------------------------------------- the roles
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'sqs_ingest_owner') THEN
        CREATE ROLE sqs_ingest_owner LOGIN;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'sqs_ingest_app') THEN
        CREATE ROLE sqs_ingest_app LOGIN;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'sqs_ingest_reconcile') THEN
        CREATE ROLE sqs_ingest_reconcile LOGIN;
    END IF;
END
$$;

-- Re-assert the attributes on every run, in case someone widened them by hand.
ALTER ROLE sqs_ingest_owner LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS;
ALTER ROLE sqs_ingest_app   LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS;
ALTER ROLE sqs_ingest_reconcile LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS;

-- The app and reconcile roles must not inherit another role's rights through membership.
DO $$
DECLARE
    m record;
BEGIN
    FOR m IN
        SELECT r.rolname AS granted, u.rolname AS member FROM pg_catalog.pg_auth_members am
        JOIN pg_catalog.pg_roles r ON r.oid = am.roleid
        JOIN pg_catalog.pg_roles u ON u.oid = am.member
        WHERE u.rolname IN ('sqs_ingest_app', 'sqs_ingest_reconcile')
    LOOP
        EXECUTE format('REVOKE %I FROM %I', m.granted, m.member);
    END LOOP;
END
$$;

DO $$
DECLARE
    owner_pw text := nullif(current_setting('sqs_ingest.owner_password', true), '');
    app_pw   text := nullif(current_setting('sqs_ingest.app_password', true), '');
    rec_pw   text := nullif(current_setting('sqs_ingest.reconcile_password', true), '');
BEGIN
    IF owner_pw !~ '^SCRAM-SHA-256\$' OR app_pw !~ '^SCRAM-SHA-256\$'
       OR rec_pw !~ '^SCRAM-SHA-256\$' THEN
        RAISE EXCEPTION 'sqs_ingest.*_password must be a SCRAM-SHA-256 verifier, not a '
            'cleartext password (scripts/scram-verifier.py makes one)';
    END IF;
    IF owner_pw IS NOT NULL THEN
        EXECUTE format('ALTER ROLE sqs_ingest_owner PASSWORD %L', owner_pw);
    END IF;
    IF app_pw IS NOT NULL THEN
        EXECUTE format('ALTER ROLE sqs_ingest_app PASSWORD %L', app_pw);
    END IF;
    IF rec_pw IS NOT NULL THEN
        EXECUTE format('ALTER ROLE sqs_ingest_reconcile PASSWORD %L', rec_pw);
    END IF;
END
$$;

-- ------------------------------------------------------------- the database
DO $$
BEGIN
    EXECUTE format('GRANT CONNECT ON DATABASE %I TO sqs_ingest_owner, sqs_ingest_app, '
                   'sqs_ingest_reconcile', current_database());
    -- PUBLIC may create temporary tables by default; the daemon needs none, so
    -- "no DDL" holds for temp tables too. (Superusers are unaffected.)
    EXECUTE format('REVOKE TEMPORARY ON DATABASE %I FROM PUBLIC', current_database());
END
$$;

-- --------------------------------------------------------------- the schema
-- Before PostgreSQL 15 every role could CREATE in public (CVE-2018-1058); 15 already
-- revokes it. Only the owner role creates objects here.
REVOKE CREATE ON SCHEMA public FROM PUBLIC;
GRANT USAGE, CREATE ON SCHEMA public TO sqs_ingest_owner;
GRANT USAGE ON SCHEMA public TO sqs_ingest_app, sqs_ingest_reconcile;

-- ----------------------------------------------------------- table privileges
-- Earlier versions of this file granted every table in the schema, and default
-- privileges for the owner's future tables: both revoked here, on every run.
ALTER DEFAULT PRIVILEGES FOR ROLE sqs_ingest_owner IN SCHEMA public
    REVOKE ALL ON TABLES FROM sqs_ingest_app, sqs_ingest_reconcile;
ALTER DEFAULT PRIVILEGES FOR ROLE sqs_ingest_owner IN SCHEMA public
    REVOKE ALL ON SEQUENCES FROM sqs_ingest_app, sqs_ingest_reconcile;
REVOKE ALL ON ALL TABLES IN SCHEMA public FROM sqs_ingest_app, sqs_ingest_reconcile;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA public FROM sqs_ingest_app, sqs_ingest_reconcile;

-- Then exactly these, table by table (a table not created yet is granted on the next run,
-- after the migration that creates it). A role that INSERTs gets USAGE on the table's
-- own sequences (bigserial ids). Why each:
--   modifications      claim (INSERT ... ON CONFLICT), complete (UPDATE), prune (DELETE)
--   retry_attempts     failure counts (upsert), cleared on completion and by prune
--   dead_letters       poison rows (INSERT), dlq replay marks replayed_at (UPDATE), prune
--   entities           the reference handlers' upserts (INSERT ... ON CONFLICT DO UPDATE)
--   entity_checkpoints the pruner's fold of pruned entity modifications (upsert)
--   outbox             results out: written with the outcome, claimed FOR UPDATE, marked
--                      published, pruned
--   workers            registration, heartbeat, orphan GC, prune
--   payload_refusals   the first time S3 refused a pointer (upsert: INSERT ... ON CONFLICT
--                      DO UPDATE ... RETURNING), pruned once not refused for the retention
--   reconciliation_*   SELECT only (`prune --dry-run` counts): the checker's evidence is
--                      written and pruned by the reconcile role alone
--   ingest_schema_migrations  SELECT only: the schema check (/readyz, start-up)
--   ingest_handler_migrations SELECT only: the same for handler packages' migrations
-- (`sqs-ingest grants --role ROLE` prints these app grants, from the same list, plus the
-- handler packages' own tables.)
-- The reconcile role reads modifications, entities, entity_checkpoints (read-only
-- sessions), replaces its date's results (DELETE + INSERT on reconciliation_runs; the
-- discrepancies cascade, run by PostgreSQL as the table owner; INSERT by COPY) and
-- deletes its runs past INGEST_RECONCILE_RETENTION_DAYS (the same cascade).
DO $$
DECLARE
    g record;
    seq record;
BEGIN
    FOR g IN SELECT * FROM (VALUES
        ('sqs_ingest_app', 'modifications',                'SELECT, INSERT, UPDATE, DELETE'),
        ('sqs_ingest_app', 'retry_attempts',               'SELECT, INSERT, UPDATE, DELETE'),
        ('sqs_ingest_app', 'dead_letters',                 'SELECT, INSERT, UPDATE, DELETE'),
        ('sqs_ingest_app', 'entities',                     'SELECT, INSERT, UPDATE'),
        ('sqs_ingest_app', 'entity_checkpoints',           'SELECT, INSERT, UPDATE'),
        ('sqs_ingest_app', 'outbox',                       'SELECT, INSERT, UPDATE, DELETE'),
        ('sqs_ingest_app', 'workers',                      'SELECT, INSERT, UPDATE, DELETE'),
        ('sqs_ingest_app', 'payload_refusals',             'SELECT, INSERT, UPDATE, DELETE'),
        ('sqs_ingest_app', 'reconciliation_runs',          'SELECT'),
        ('sqs_ingest_app', 'reconciliation_discrepancies', 'SELECT'),
        ('sqs_ingest_app', 'ingest_schema_migrations',     'SELECT'),
        ('sqs_ingest_app', 'ingest_handler_migrations',    'SELECT'),
        ('sqs_ingest_reconcile', 'modifications',                'SELECT'),
        ('sqs_ingest_reconcile', 'entities',                     'SELECT'),
        ('sqs_ingest_reconcile', 'entity_checkpoints',           'SELECT'),
        ('sqs_ingest_reconcile', 'reconciliation_runs',          'SELECT, INSERT, DELETE'),
        ('sqs_ingest_reconcile', 'reconciliation_discrepancies', 'INSERT')
    ) AS t(grantee, tbl, privs)
    LOOP
        CONTINUE WHEN to_regclass(format('public.%I', g.tbl)) IS NULL;
        EXECUTE format('GRANT %s ON TABLE public.%I TO %I', g.privs, g.tbl, g.grantee);
        CONTINUE WHEN g.privs NOT LIKE '%INSERT%';
        FOR seq IN
            SELECT s.oid::regclass AS name FROM pg_catalog.pg_class s
            JOIN pg_catalog.pg_depend d ON d.objid = s.oid AND d.deptype IN ('a', 'i')
            WHERE s.relkind = 'S' AND d.refobjid = format('public.%I', g.tbl)::regclass
        LOOP
            EXECUTE format('GRANT USAGE ON SEQUENCE %s TO %I', seq.name, g.grantee);
        END LOOP;
    END LOOP;
END
$$;
