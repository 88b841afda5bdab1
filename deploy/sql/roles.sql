-- Database roles for sqs-ingest. Run as a superuser (or a role with CREATEROLE that
-- owns the database), connected to the target database, BEFORE the first migration:
--
--   PGOPTIONS='-c sqs_ingest.owner_password=... -c sqs_ingest.app_password=...' \
--     psql -v ON_ERROR_STOP=1 -d ingest -f deploy/sql/roles.sql
--
-- Two roles:
--   sqs_ingest_owner  runs `sqs-ingest migrate`: owns the tables, the only one with DDL.
--   sqs_ingest_app    the daemon, `gc`, `dlq` and the reconcile job: rows only
--                     (SELECT/INSERT/UPDATE/DELETE, sequences), no DDL, no CREATE anywhere.
--
-- Plain SQL (no psql meta-commands) so any client can apply it. Idempotent: every
-- statement may run again; re-running also grants on tables that already exist.
-- Passwords are optional settings read from the session (PGOPTIONS as above, or
-- `SET sqs_ingest.app_password = '...'` first); unset means "leave the password alone"
-- (for IAM/certificate auth, or passwords managed elsewhere).

-- ---------------------------------------------------------------- the roles
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'sqs_ingest_owner') THEN
        CREATE ROLE sqs_ingest_owner LOGIN;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'sqs_ingest_app') THEN
        CREATE ROLE sqs_ingest_app LOGIN;
    END IF;
END
$$;

-- Re-assert the attributes on every run, in case someone widened them by hand.
ALTER ROLE sqs_ingest_owner LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS;
ALTER ROLE sqs_ingest_app   LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS;

-- The app role must not inherit the owner's rights through membership.
DO $$
BEGIN
    IF EXISTS (
        SELECT FROM pg_catalog.pg_auth_members m
        JOIN pg_catalog.pg_roles r ON r.oid = m.roleid
        JOIN pg_catalog.pg_roles u ON u.oid = m.member
        WHERE r.rolname = 'sqs_ingest_owner' AND u.rolname = 'sqs_ingest_app'
    ) THEN
        REVOKE sqs_ingest_owner FROM sqs_ingest_app;
    END IF;
END
$$;

DO $$
DECLARE
    owner_pw text := nullif(current_setting('sqs_ingest.owner_password', true), '');
    app_pw   text := nullif(current_setting('sqs_ingest.app_password', true), '');
BEGIN
    IF owner_pw IS NOT NULL THEN
        EXECUTE format('ALTER ROLE sqs_ingest_owner PASSWORD %L', owner_pw);
    END IF;
    IF app_pw IS NOT NULL THEN
        EXECUTE format('ALTER ROLE sqs_ingest_app PASSWORD %L', app_pw);
    END IF;
END
$$;

-- ------------------------------------------------------------- the database
DO $$
BEGIN
    EXECUTE format('GRANT CONNECT ON DATABASE %I TO sqs_ingest_owner, sqs_ingest_app',
                   current_database());
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
GRANT USAGE ON SCHEMA public TO sqs_ingest_app;

-- ----------------------------------------------------------- table privileges
-- Tables and sequences that already exist (roles.sql re-run after migrations) ...
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO sqs_ingest_app;
GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO sqs_ingest_app;

-- ... and every table or sequence the owner role creates from now on (migrations): e.g.
-- `outbox` (002), which the daemon inserts into, claims with SELECT ... FOR UPDATE (needs
-- UPDATE), marks published and prunes (DELETE); `entity_checkpoints` (004), which the
-- pruner upserts (INSERT ... ON CONFLICT DO UPDATE) and the reconcile job reads. Retention
-- (`sqs-ingest prune`) needs nothing more: DELETE on the tables, and a session advisory
-- lock, which any role may take. tests/integration/test_roles.py runs both.
ALTER DEFAULT PRIVILEGES FOR ROLE sqs_ingest_owner IN SCHEMA public
    GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO sqs_ingest_app;
ALTER DEFAULT PRIVILEGES FOR ROLE sqs_ingest_owner IN SCHEMA public
    GRANT USAGE, SELECT ON SEQUENCES TO sqs_ingest_app;
