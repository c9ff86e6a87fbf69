-- Revert pginbox:security
BEGIN;

DROP FUNCTION inbox.configure_security(boolean, boolean, interval, text);
DROP FUNCTION inbox.unbind_consumer(text, regrole, text);
DROP FUNCTION inbox.bind_consumer(text, regrole, text[], text);
DROP FUNCTION inbox._check_note(text, text);
DROP FUNCTION inbox._check_operator_run(text, text, regprocedure, text, boolean);
DROP FUNCTION inbox._authorize(text, text, text);
DROP FUNCTION inbox._may_act_as(text, text);
DROP FUNCTION inbox._acting_as(text, text);
DROP FUNCTION inbox._consumer_base(text);

COMMIT;
