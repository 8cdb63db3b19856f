"""Events are partitioned by month: the month their invocation was recorded in.

DESIGN §9 asks for an event table partitioned by time as it grows. The partition key
is the invocation's `created_at`, copied onto each of its events as
`invocation_created_at`, not the event's own time: all the events of one invocation
then share a partition, so the unique index that refuses a forked chain, which must
contain the partition key, still means "one event per (invocation, seq)". Nothing
can move an invocation between partitions: its `created_at` is now as immutable as
its events (the trigger below).

`ledger_create_event_partitions(from, through)` makes the month partitions between
two times that are missing, and answers their names. It runs with its owner's rights
(the role that migrated), so the application's role, which owns nothing (README,
Database roles), can call it from beat (ledger.partitions). Events that find no month
partition land in `ledger_event_default`, so nothing is refused for want of one; a
month whose rows are there already keeps them there (its partition cannot be
attached), and is named in a warning. Each month gets the statistics of migration
0024 for its own rows: the planner estimates each partition from its own.

A partitioned table cannot have a unique index without its partition key, so the
primary key becomes (id, invocation_created_at) — ids still come from one sequence,
and Django still addresses an event by `id` — and the sealed events' foreign key to
the event goes (nothing can delete an event to leave a dangling one: it is refused).

Existing events are copied into the partitioned table within this migration, which
holds the table exclusively while it does: 9.3 s for bench_audit's million (small)
events, spread over twelve months, on a 2-core machine.
"""

from django.db import migrations, models

COLUMNS = """
  id bigint NOT NULL,
  seq integer NOT NULL CONSTRAINT ledger_event_seq_check CHECK (seq >= 0),
  kind varchar(48) NOT NULL,
  actor varchar(160) NOT NULL,
  data jsonb NOT NULL,
  created_at timestamptz NOT NULL,
  prev_hash varchar(64) NOT NULL,
  hash varchar(64) NOT NULL,
  invocation_id bigint NOT NULL
"""
COPIED = "id, seq, kind, actor, data, created_at, prev_hash, hash, invocation_id"

# Those of models.Event but the unique one and the primary key, which differ.
INDEXES = """
CREATE INDEX event_created_at ON ledger_event (created_at);
CREATE INDEX event_by_person ON ledger_event (actor, invocation_id)
  WHERE actor::text LIKE 'user:%';
CREATE INDEX event_probe_run_time ON ledger_event (created_at) WHERE kind::text = 'probe_run';
CREATE INDEX event_business_reference ON ledger_event ((data -> 'business_reference'))
  WHERE (data -> 'business_reference') > '""'::jsonb;
CREATE INDEX event_shared_reference_time ON ledger_event (created_at)
  WHERE data ? 'also_named_by' OR data ? 'also_named_elsewhere';
CREATE STATISTICS event_business_reference_statistics
  ON ((data -> 'business_reference')) FROM ledger_event;
ALTER TABLE ledger_event ADD CONSTRAINT ledger_event_invocation_id_92fb8c43_fk_ledger_invocation_id
  FOREIGN KEY (invocation_id) REFERENCES ledger_invocation (id) DEFERRABLE INITIALLY DEFERRED;
CREATE TRIGGER ledger_event_append_only BEFORE UPDATE OR DELETE ON ledger_event
  FOR EACH ROW EXECUTE FUNCTION ledger_refuse_change();
"""

SEALED_EVENT_FOREIGN_KEY = """
ALTER TABLE ledger_sealedevent ADD CONSTRAINT ledger_sealedevent_event_id_4cfd7f11_fk_ledger_event_id
  FOREIGN KEY (event_id) REFERENCES ledger_event (id) DEFERRABLE INITIALLY DEFERRED;
"""

SEQ_UNIQUE = "UNIQUE (invocation_id, seq, invocation_created_at)"

CREATE_PARTITIONS = f"""
CREATE FUNCTION ledger_create_event_partitions(from_time timestamptz, through_time timestamptz)
RETURNS text[] LANGUAGE plpgsql SECURITY DEFINER
-- Months are UTC months whatever the caller's time zone; a partition is never waited
-- for long, because the statements queued behind the wait would be the ledger's writes.
-- (Its search_path is set below, to the ledger's schema and then pg_temp.)
SET TimeZone = 'UTC' SET lock_timeout = '5s'
AS $$
DECLARE
  month timestamptz := date_trunc('month', from_time);
  partition text;
  made text[] := '{{}}';
BEGIN
  -- Anyone may call this; it makes a bounded number of tables.
  IF through_time > now() + interval '2 years' OR through_time - from_time > interval '50 years' THEN
    RAISE EXCEPTION 'event partitions are made at most two years ahead and 50 years at once'
      USING ERRCODE = 'invalid_parameter_value';
  END IF;
  WHILE month <= through_time LOOP
    partition := 'ledger_event_' || to_char(month, 'YYYY_MM');
    IF to_regclass(partition) IS NULL THEN
      BEGIN
        EXECUTE format(
          'CREATE TABLE %I (LIKE ledger_event INCLUDING DEFAULTS INCLUDING CONSTRAINTS)', partition);
        -- Named, not left to PostgreSQL: the evidence SQL tells a lost race by this name.
        EXECUTE format('ALTER TABLE %I ADD CONSTRAINT %I %s', partition,
                       partition || '_event_seq_unique', '{SEQ_UNIQUE}');
        -- Attaching takes a lock that lets the ledger's writes through; indexes,
        -- trigger and foreign key come from the partitioned table.
        EXECUTE format('ALTER TABLE ledger_event ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
                       partition, month, month + interval '1 month');
        EXECUTE format('CREATE STATISTICS %I ON ((data -> ''business_reference'')) FROM %I',
                       partition || '_business_reference', partition);
        made := made || partition;
      EXCEPTION WHEN check_violation THEN
        RAISE WARNING 'events of % are in ledger_event_default: no partition made for that month',
          to_char(month, 'YYYY-MM');
      END;
    END IF;
    month := month + interval '1 month';
  END LOOP;
  RETURN made;
END
$$;
-- A function run with its owner's rights must not find tables by its caller's path.
DO $$ BEGIN
  EXECUTE format('ALTER FUNCTION ledger_create_event_partitions(timestamptz, timestamptz) '
                 'SET search_path = %I, pg_temp', current_schema());
END $$;
"""

FORWARD = f"""
CREATE TABLE ledger_event_partitioned ({COLUMNS},
  invocation_created_at timestamptz NOT NULL
) PARTITION BY RANGE (invocation_created_at);
ALTER TABLE ledger_sealedevent
  DROP CONSTRAINT ledger_sealedevent_event_id_4cfd7f11_fk_ledger_event_id;
ALTER TABLE ledger_event RENAME TO ledger_event_unpartitioned;
ALTER TABLE ledger_event_partitioned RENAME TO ledger_event;
{CREATE_PARTITIONS}
SELECT ledger_create_event_partitions(
  coalesce((SELECT min(created_at) FROM ledger_invocation), now()), now() + interval '3 months');
CREATE TABLE ledger_event_default (LIKE ledger_event INCLUDING DEFAULTS INCLUDING CONSTRAINTS);
ALTER TABLE ledger_event_default ADD CONSTRAINT ledger_event_default_event_seq_unique {SEQ_UNIQUE};
ALTER TABLE ledger_event ATTACH PARTITION ledger_event_default DEFAULT;
CREATE STATISTICS ledger_event_default_business_reference
  ON ((data -> 'business_reference')) FROM ledger_event_default;
INSERT INTO ledger_event ({COPIED}, invocation_created_at)
  SELECT {", ".join(f"e.{c}" for c in COPIED.split(", "))}, i.created_at
  FROM ledger_event_unpartitioned e JOIN ledger_invocation i ON i.id = e.invocation_id;
DROP TABLE ledger_event_unpartitioned;
CREATE SEQUENCE ledger_event_id_seq OWNED BY ledger_event.id;
SELECT setval('ledger_event_id_seq', coalesce((SELECT max(id) FROM ledger_event), 0) + 1, false);
ALTER TABLE ledger_event ALTER COLUMN id SET DEFAULT nextval('ledger_event_id_seq');
ALTER TABLE ledger_event ADD CONSTRAINT ledger_event_pkey PRIMARY KEY (id, invocation_created_at);
ALTER TABLE ledger_event ADD CONSTRAINT event_seq_unique {SEQ_UNIQUE};
{INDEXES}
CREATE TRIGGER ledger_invocation_created_at_fixed BEFORE UPDATE OF created_at ON ledger_invocation
  FOR EACH ROW WHEN (OLD.created_at IS DISTINCT FROM NEW.created_at)
  EXECUTE FUNCTION ledger_refuse_change();
"""  # noqa: S608 (the module's own constants)

BACKWARD = f"""
DROP TRIGGER ledger_invocation_created_at_fixed ON ledger_invocation;
CREATE TABLE ledger_event_unpartitioned ({COLUMNS});
INSERT INTO ledger_event_unpartitioned ({COPIED}) SELECT {COPIED} FROM ledger_event;
DROP TABLE ledger_event;
DROP FUNCTION ledger_create_event_partitions(timestamptz, timestamptz);
ALTER TABLE ledger_event_unpartitioned RENAME TO ledger_event;
ALTER TABLE ledger_event ALTER COLUMN id ADD GENERATED BY DEFAULT AS IDENTITY;
SELECT setval(pg_get_serial_sequence('ledger_event', 'id'),
              coalesce((SELECT max(id) FROM ledger_event), 0) + 1, false);
ALTER TABLE ledger_event ADD CONSTRAINT ledger_event_pkey PRIMARY KEY (id);
ALTER TABLE ledger_event ADD CONSTRAINT event_seq_unique UNIQUE (invocation_id, seq);
{INDEXES}
{SEALED_EVENT_FOREIGN_KEY}
"""  # noqa: S608 (the module's own constants)


class Migration(migrations.Migration):
    dependencies = [("ledger", "0032_rate_watch")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunSQL(FORWARD, BACKWARD)],
            state_operations=[
                migrations.AddField(
                    model_name="event",
                    name="invocation_created_at",
                    field=models.DateTimeField(editable=False),
                ),
                migrations.RemoveConstraint(model_name="event", name="event_seq_unique"),
                migrations.AddConstraint(
                    model_name="event",
                    constraint=models.UniqueConstraint(
                        fields=["invocation", "seq", "invocation_created_at"],
                        name="event_seq_unique",
                    ),
                ),
                migrations.AlterField(
                    model_name="sealedevent",
                    name="event",
                    field=models.OneToOneField(
                        db_constraint=False,
                        on_delete=models.deletion.PROTECT,
                        related_name="sealed",
                        to="ledger.event",
                    ),
                ),
            ],
        )
    ]
