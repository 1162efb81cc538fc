"""reach: every host reaches the launch host by TCP on a cluster-side address, as the run's
supervisors (and torchrun's / msrun's master, MASTER_ADDR) will; not only ssh from here.

How, without a session of its own: the launch host's probe opens a listener first thing (python3,
which the run's supervisor needs anyway, on a port the kernel picks, on each address the hosts
will test, never the wildcard) and prints
its port and its global IPv4 addresses; `orch check` hands them (Relay) to the other hosts'
probes, which it sends once they are known (their SSH handshakes go on meanwhile). Each of those
connects to every candidate at once (the address the run will use first: launchers.head_reach,
then the launch host's other addresses), presents the check's random token and must get the
listener's own token back; it prints what each address did. The listener answers only a peer
that presents the token, reads at most READ_LIMIT bytes from each, waits PEER_TIMEOUT for them,
and is gone once every other host has presented it (plus GRACE, for the same host's other
addresses still on their way) or after its cap (reach_cap), whichever comes first: it is detached
from the probe, so a host that never comes (its SSH failed) delays nothing.
"""

from __future__ import annotations

import hashlib
import math
import shlex
import threading
import time
from dataclasses import replace

from .. import probes, sh
from ..hostlayout import PY
from ..launchers import HeadReach, head_reach
from ..model import Host
from ..probes import NOT_INSTALLED, SECTION_TIMEOUT, Listen, ReachTarget, Section
from ..agent.layout import DIR_VAR, RUN_VAR
from ..devices import HCCN_CONF
from ..prepare import prepare_script, probe_facts, probe_section
from ..supervisor import FACTS_PY, PYTHON_PY, agent_home, parse_python, run_env
from ..sync import LIST_ENV, LIST_INSIDE, list_heredoc
from ..transport.base import HELD_EXIT, HELD_GO
from .base import Check, CheckResult, Probe, register, result, section

SECTION = probes.GIVEN_BY   # "reach": the section whose program gives others (probes.split_sections)
GRACE = 2.0         # seconds the listener stays once every host has come (their other addresses)
PEER_TIMEOUT = 2.0  # seconds the listener waits for one peer's token
READ_LIMIT = 256    # bytes the listener (and a host's test) reads from one peer at most
MAX_CAP = 300.0     # seconds: the listener's longest life, however many rounds the fan-out takes
ENV_IN, ENV_OUT = "ORCH_REACH_IN", "ORCH_REACH_OUT"  # the tokens, in the environment (never a command line)

# Both programs compare tokens with hmac.compare_digest's own C function (_operator's): importing
# hmac loads hashlib and OpenSSL, ~30 ms of every start. They use the C modules under socket and
# threading (_socket, _thread) for the same reason: `import socket` loads enum, selectors and io's
# wrappers, ~8 ms of CPU on every host (python3 -S alone starts in ~9 ms); and an address that is
# an IP needs no getaddrinfo (glibc's asks the kernel which address families it has and loads
# its resolver: another ~8 ms). AI is that lookup, getaddrinfo's answer for an IP made here.
AI_PY = r"""def ai(a,p):
 for f in (S.AF_INET,S.AF_INET6):
  try:S.inet_pton(f,a);return [(f,S.SOCK_STREAM,0,"",(a,p) if f==S.AF_INET else (a,p,0,0))]
  except OSError:pass
 return S.getaddrinfo(a,p,0,S.SOCK_STREAM)
"""
#
# The listener: bind one port on each address it is given (the ones the hosts will test: the
# run's first address, argv, and the host's global addresses ADDRS_SH printed, on stdin), never on
# the wildcard; print the port, detach (a new session, stdio on /dev/null: the probe's output ends
# without it), then answer until every one of N hosts came (+GRACE) or CAP seconds passed.
# argv: N CAP GRACE PEER_TIMEOUT READ_LIMIT ADDRESS.
LISTEN_PY = r"""import os,sys,_socket as S,select,time
from _operator import _compare_digest as eq
%(ai)sn,cap,grace,pt,lim=int(sys.argv[1]),float(sys.argv[2]),float(sys.argv[3]),float(sys.argv[4]),int(sys.argv[5])
ti,to=os.environ.pop("%(in)s").encode(),os.environ.pop("%(out)s").encode()
want=sys.argv[6:]+[l.split()[1] for l in sys.stdin.read(65536).splitlines() if l.startswith("addr ")]
ss,p=[],0
for a in want:
 try:
  for f,_,_,_,sa in ai(a,p):
   x=S.socket(f,S.SOCK_STREAM)
   try:x.setsockopt(S.SOL_SOCKET,S.SO_REUSEADDR,1);x.bind(sa);x.listen(128);ss.append(x);p=x.getsockname()[1]
   except OSError:x.close()
 except OSError:pass
if not ss:sys.exit("cannot listen on "+(" ".join(want) or "any address"))
print(p);sys.stdout.flush()
if os.fork():os._exit(0)
os.setsid();d=os.open(os.devnull,os.O_RDWR)
for i in (0,1,2):os.dup2(d,i)
j=3
for k in sorted(x.fileno() for x in ss):os.closerange(j,k);j=k+1
os.closerange(j,min(65536,os.sysconf("SC_OPEN_MAX")))
t0=time.monotonic();end=t0+cap;seen=set()
while 1:
 w=end-time.monotonic()
 r=select.select(ss,[],[],w)[0] if w>0 else []
 if not r:break
 c=None
 try:
  k,_=r[0]._accept();c=S.socket(r[0].family,S.SOCK_STREAM,0,k);c.settimeout(pt);b=b""
  while b"\n" not in b and len(b)<lim:
   x=c.recv(lim-len(b))
   if not x:break
   b+=x
  f=b.split(b"\n")[0].split(b" ")
  if len(f)==2 and eq(f[0],ti):
   c.sendall(to+b"\n");seen.add(f[1])
   if len(seen)>=n:end=min(t0+cap,time.monotonic()+grace)
 except OSError:pass
 finally:
  if c is not None:c.close()
""" % {"in": ENV_IN, "out": ENV_OUT, "ai": AI_PY}

# A host's test: connect to every address at once, present the token with this host's index, read
# the listener's token back; print `to ADDR ok|WHY` in the given order. argv: INDEX PORT TIMEOUT ADDR...
# (connect: socket.create_connection's loop, the last address family's error kept). It first prints
# what check path asks python3 for (the run's supervisor's version, as supervisor.python_sh
# prints it) and, in `orch up`, what prepare reads with it (the workdir's lock, the agent
# package: supervisor.FACTS_PY) and what the host has of the sync (sync.LIST_INSIDE; lists_sync):
# the same python3 -S on the same PATH, and one start of it per host, not three (~7 ms of CPU
# each on every host; path's section and the synclist then leave it out: tests_by_python).
_CONNECT = r"""import os,sys,_socket as S,_thread
from _operator import _compare_digest as eq
%(ai)si,p,t,a=sys.argv[1],int(sys.argv[2]),float(sys.argv[3]),sys.argv[4:]
ti,to=os.environ.pop("%(in)s").encode(),os.environ.pop("%(out)s").encode();r={}
def conn(x):
 e=OSError("getaddrinfo returns an empty list")
 for f,k,q,_,sa in ai(x,p):
  c=S.socket(f,k,q)
  try:c.settimeout(t);c.connect(sa);return c
  except OSError as y:e=y;c.close()
 raise e
def one(x,l):
 try:
  try:c=conn(x)
  except S.timeout:r[x]="timed out after %%gs"%%t;return
  except OSError as e:r[x]=(e.strerror or str(e)).lower();return
  try:
   c.settimeout(t);c.sendall(ti+b" "+i.encode()+b"\n");b=b""
   while b"\n" not in b and len(b)<%(lim)d:
    y=c.recv(%(lim)d-len(b))
    if not y:break
    b+=y
   r[x]="ok" if eq(b.split(b"\n")[0],to) else "connected, but "+("something else answers on the port" if b else
    "closed without an answer")
  except S.timeout:r[x]="connected, but no answer within %%gs"%%t
  except OSError as e:r[x]="connected, then "+(e.strerror or str(e)).lower()
  finally:c.close()
 finally:l.release()
h=[]
for x in a:
 l=_thread.allocate_lock();l.acquire();h.append(l);_thread.start_new_thread(one,(x,l))
for l in h:l.acquire(True,2*t+1)
for x in a:print("to",x,r.get(x,"no answer within %%gs"%%(2*t+1)))
""" % {"in": ENV_IN, "out": ENV_OUT, "lim": READ_LIMIT, "ai": AI_PY}
# After the test, in `orch up`, the listing (sync.LIST_INSIDE), with the time the probe gives any
# command (probes.SECTION_TIMEOUT; a hung stat then ends the program, the test's lines out already)
_LIST_AFTER = "sys.stdout.flush()\nimport _signal\n_signal.alarm(%d)\n" % SECTION_TIMEOUT + LIST_INSIDE


# `orch up`: once it has tested and listed, the program stays, in the background of the probe,
# to be this host's supervisor (holds): the supervisor's start then needs no SSH session and no
# python3 start of its own (sshd's session, the login shell, sh, python3: ~13 ms of CPU a host).
# It says `held`, then a child of it keeps the channel's stdin (fd 3), stdout (4) and stderr (5),
# pipes or sockets which the probe's shell gave only to it, and 7, which keeps the session's shell
# waiting (probes.assemble; the command it runs gets none of them but 0-2), and waits for
# `go N\n` and N bytes, the start's environment and arguments (transport.held_go): HOLD_ENV's
# seconds for the first byte, 30 for each further piece. It answers HELD_GO and runs them as
# `python3 -S -c` would (the start's boot, supervisor.boot) in a child, whose exit status
# follows its output (HELD_EXIT). Its stdin at EOF, no go in time, anything else: it exits and
# nothing started (the start then takes a session of its own). A thread of the test still alive
# (an address that did not answer): it does not hold (no fork beside a thread). As a fresh python3:
# SIGINT and SIGQUIT at their defaults (a background job of sh has them ignored), the streams'
# encodings and error handlers; the variables the probe gave the test (HOLD_ENV names them after
# the seconds) gone from its environment. /proc/PID/environ, which no process can rewrite, still
# shows them, as `ps` shows the test's command line.
HOLD_ENV = "ORCH_HOLD"
HELD = "held"
HOLD_PY = r"""def _hold(v):
 import select,_signal as G,_thread
 secs,names=float(v.split()[0]),v.split()[1:]
 try:
  if _thread._count() or not all(os.fstat(i).st_mode&0o170000 in (0o010000,0o140000) for i in (3,4,5,7)):
   return
 except OSError:return
 print("%(held)s");sys.stdout.flush()
 if os.fork():return
 os.setsid();d=os.open(os.devnull,os.O_RDWR)
 for i in (0,1,2):os.dup2(d,i)
 for f in os.listdir("/proc/self/fd"):
  if int(f) not in (0,1,2,3,4,5,7):
   try:os.close(int(f))
   except OSError:pass
 b=b"";n=-1;w=secs
 while n<0 or len(b)<n:
  if not select.select([3],[],[],w)[0]:os._exit(0)
  x=os.read(3,65536);w=30
  if not x:os._exit(0)
  b+=x
  if n<0 and b"\n" in b:
   h,_,b=b.partition(b"\n");h=h.split()
   if len(h)!=2 or h[0]!=b"go" or not h[1].isdigit() or not 0<int(h[1])<=1<<20:os._exit(2)
   n=int(h[1])
  elif n<0 and len(b)>64:os._exit(2)
 f=b.split(b"\0")
 if len(b)!=n or not f[0].isdigit() or len(f)<2+2*int(f[0]):os._exit(2)
 k=int(f[0]);e,a=f[1:1+2*k],[os.fsdecode(x) for x in f[1+2*k:]]
 os.write(4,%(go)r)
 p=os.fork()
 if not p:
  c=1
  try:
   q=[(x.encoding,x.errors) for x in (sys.__stdin__,sys.__stdout__,sys.__stderr__)]
   for i in (0,1,2):os.dup2(i+3,i)
   for i in (3,4,5,7):os.close(i)
   G.signal(G.SIGINT,G.default_int_handler);G.signal(G.SIGQUIT,G.SIG_DFL)
   for x in names:os.environ.pop(x,None)
   for i in range(k):os.environ[os.fsdecode(e[2*i])]=os.fsdecode(e[2*i+1])
   sys.stdin=open(0,"r",encoding=q[0][0],errors=q[0][1],closefd=False)
   sys.stdout=open(1,"w",encoding=q[1][0],errors=q[1][1],closefd=False)
   sys.stderr=open(2,"w",buffering=1,encoding=q[2][0],errors=q[2][1],closefd=False);sys.argv=["-c"]+a[1:]
   exec(compile(a[0],"<string>","exec"),{"__name__":"__main__","__builtins__":__builtins__});c=0
  except SystemExit as x:
   c=x.code
   if c is None:c=0
   elif not isinstance(c,int):sys.stderr.write("%%s\n"%%c);c=1
  except BaseException:
   import traceback;traceback.print_exc()
  try:sys.stdout.flush();sys.stderr.flush()
  except Exception:pass
  os._exit(c)
 os.close(3);os.close(5);_,t=os.waitpid(p,0)
 os.write(4,b"\n%(exit)s %%d\n"%%(os.WEXITSTATUS(t) if os.WIFEXITED(t) else 128+os.WTERMSIG(t)))
 os._exit(0)
_s=os.environ.pop("%(env)s","")
if _s:_hold(_s)
""" % {"held": HELD, "go": HELD_GO, "exit": HELD_EXIT.decode(), "env": HOLD_ENV}


# Sections the test's python3 prints for the sh (given: their commands cost ~10 ms of CPU a host,
# in 11-12 execs: id, cat (where /etc/hccn.conf is), grep, tr, uname, timeout and python3, mktemp,
# rm, id, readlink, stat; the clock's first `date` 0.7 ms more; df's timeout and df ~2 ms: statvfs and
# /proc/self/mounts, on the path the workdir's section has already touched; nic's ip ~1.6 ms: netlink's
# RTM_GETADDR dump, as ip asks it, 0.3 ms), each as the sh's commands print it (error messages in coreutils' words;
# stale's values cut as sh.env_values cuts them), first thing,
# between GIVEN_BEGIN and GIVEN_END (probes.split_sections takes them out of the reach section's
# output). Where it does not run them (no python3, or it failed first), the sh does, after the
# reach section (probes.assemble's `given`). PYTHON_DOES: the sections it can give, each for the
# one command of given(); tests/unit/test_given.py runs both ways and compares what they print.
GIVEN_ENV, SELF_ENV, WORKDIR_ENV = "ORCH_GIVEN", "ORCH_SELF", "ORCH_GIVEN_W"
PYTHON_DOES = ("user", "hccn", "stale", "prepare", "ver:python", "workdir", "df", "nic", "clock0")
GIVEN_PY = r"""def _nic():
 # `ip -o addr show`'s lines (index: name, family, address/prefix), from the kernel's own answer
 # (netlink RTM_GETADDR, as ip asks it): no exec of ip
 import sys,_socket as S
 L=lambda b,i,n:int.from_bytes(b[i:i+n],sys.byteorder)
 s=S.socket(16,S.SOCK_RAW,0)   # AF_NETLINK, NETLINK_ROUTE
 try:
  s.settimeout(5);s.bind((0,0))
  s.send((24).to_bytes(4,sys.byteorder)+(22).to_bytes(2,sys.byteorder)+(0x301).to_bytes(2,sys.byteorder)+bytes(16))
  out=[];done=False
  while not done:
   d=s.recv(1<<16);i=0
   while i+16<=len(d):
    n,t=L(d,i,4),L(d,i+4,2)
    if n<16:raise ValueError("netlink")
    if t==3:done=True;break   # NLMSG_DONE
    if t==2:raise OSError("netlink error")
    if t==20:   # RTM_NEWADDR: ifaddrmsg, then its attributes
     f,pl,x=d[i+16],d[i+17],L(d,i+20,4);j=i+24;a={}
     while j+4<=i+n:
      m,k=L(d,j,2),L(d,j+2,2)
      if m<4:break
      a[k]=d[j+4:j+m];j+=(m+3)&~3
     v,w=a.get(2),a.get(1)   # IFA_LOCAL, IFA_ADDRESS: a point-to-point's peer where they differ
     if (v or w) and f in(2,10):out.append((x,f,"%%d: %%s    %%s %%s\n"%%(x,S.if_indextoname(x),"inet" if f==2 else "inet6",
      "%%s peer %%s/%%d"%%(S.inet_ntop(f,v),S.inet_ntop(f,w),pl) if v and w and v!=w else "%%s/%%d"%%(S.inet_ntop(f,v or w),pl))))
    i+=(n+3)&~3
 finally:s.close()
 if not out:raise ValueError("no address")
 return "".join(l for _,_,l in sorted(out,key=lambda o:o[:2])).encode()
def _given():
 global _RD
 import os,sys
 g=os.environ.pop("%(env)s","").split();me=os.environ.pop("%(self)s","");W=os.environ.pop("%(wenv)s","")
 if not g:return
 import _signal   # a section that hangs (statvfs on a dead NFS mount) ends the program: the sh then
 _signal.alarm(%(limit)d)   # runs them all, each under its own timeout
 sys.stdout.flush();o=sys.stdout.buffer;o.write(b"%(begin)s\n")
 for n in g:
  rc,b=0,b""
  try:
   if n=="clock0":
    import time;b=b"%%.9f\n"%%time.time()
   elif n=="user":
    import pwd
    try:b=os.fsencode(pwd.getpwuid(os.geteuid()).pw_name)+b"\n"
    except KeyError:rc,b=1,b"id: cannot find name for user ID %%d\n"%%os.geteuid()
   elif n=="hccn":
    p="%(hccn)s"
    if os.path.isfile(p):
     try:
      with open(p,"rb") as f:b=f.read()
     except OSError as e:rc,b=1,("cat: %%s: %%s\n"%%(p,e.strerror)).encode()
    else:b=b"%(ni)s\n"
   elif n=="stale":
    b=("self=%%s\n"%%me).encode();_RD=[]
    for q in os.listdir("/proc"):
     if q.isdigit():
      try:
       with open("/proc/%%s/environ"%%q,"rb") as f:e=f.read()
      except OSError:continue
      if b"%(rundir)s=" in e:_RD.append(e)   # what the facts' _live looks for: one read of /proc for both
      if b"%(run)s=" not in e:continue        # searched whole first, in C: most processes are no run's
      for x in e.split(b"\0"):
       if x.startswith(b"%(run)s="):
        v=x[%(runlen)d:];b+=b"/proc/%%s/environ:%%s%%s\n"%%(q.encode(),x[:%(runlen)d],v[:len(v)-len(v.lstrip(b"%(chars)s"))])
   elif n=="df":
    d=W
    while not os.path.isdir(d):d=d.rsplit("/",1)[0] or "/"
    v=os.statvfs(d);K=lambda x:-(-x*v.f_frsize//1024)   # df -Pk: 1024-byte blocks, rounded up
    u,a=K(v.f_blocks-v.f_bfree),K(v.f_bavail);m,f="/","-";r=os.path.realpath(d)
    U=lambda y:y.replace(b"\\040",b" ").replace(b"\\011",b"\t").replace(b"\\012",b"\n").replace(b"\\134",b"\\")
    try:
     with open("/proc/self/mounts","rb") as h:
      for x in h.read().split(b"\n"):
       x=x.split(b" ")
       if len(x)<2:continue
       q=os.fsdecode(U(x[1]))
       if (r==q or r.startswith(q.rstrip("/")+"/")) and len(q)>=len(m):m,f=q,os.fsdecode(U(x[0]))
    except OSError:pass
    b=os.fsencode("Filesystem     1024-blocks      Used Available Capacity Mounted on\n%%s %%d %%d %%d %%s %%s\n"%%(
     f,K(v.f_blocks),u,a,"%%d%%%%"%%-(-u*100//(u+a)) if u+a else "-",m))
   elif n=="nic":
    try:b=_nic()
    except (OSError,ValueError,IndexError):   # no netlink here (a sandbox): as the sh does it
     x=os.popen("{ ip -o addr show 2>/dev/null || hostname -I; } 2>&1");b=os.fsencode(x.read());x=x.close()
     if x:rc=x>>8 or 1
   elif n=="prepare":b=("arch %%s\n"%%os.uname().machine).encode()
   elif n=="ver:python":b=("Python %%s\n"%%sys.version.split()[0]).encode()
   elif n=="workdir":
    t=[]
    if os.path.isdir(W):t.append("existed=yes")
    else:
     t.append("existed=no")
     try:os.makedirs(W,exist_ok=True);t.append("mkdir=ok")
     except OSError as e:t.append("mkdir=mkdir: cannot create directory '%%s': %%s"%%(e.filename or W,e.strerror))
    if os.path.isdir(W):
     f=os.path.join(W,".orch-check."+os.urandom(6).hex())
     try:os.close(os.open(f,os.O_WRONLY|os.O_CREAT|os.O_EXCL|os.O_NOFOLLOW,0o600));os.unlink(f);t.append("write=ok")
     except OSError as e:t.append("write=mktemp: failed to create file via template '%%s': %%s"%%(
      os.path.join(W,".orch-check.XXXXXXXX"),e.strerror))
    t.append("uid=%%d"%%os.geteuid());r=os.path.realpath(W)
    walk=not os.path.isdir(os.path.dirname(r))   # readlink -f fails: the existing parents of W itself
    d=W if walk else r;c=[d]
    while d not in("/",""):d=os.path.dirname(d);c.append(d)
    for x in c:
     try:
      if walk and not os.path.exists(x):continue
      s=os.lstat(x);t.append("perm=%%o %%d %%s"%%(s.st_mode&0o7777,s.st_uid,x))
     except OSError:pass
    b=os.fsencode("\n".join(t)+"\n")
  except Exception as e:rc,b=1,b+("orch: %%s: %%s\n"%%(type(e).__name__,e)).encode()
  n=n.encode();o.write(b"%(mark)sbegin %%s\n%%s\n%(mark)send %%s %%d\n"%%(n,b,n,rc))
 o.write(b"%(end)s\n");o.flush();_signal.alarm(0)
_given()
""" % {"limit": SECTION_TIMEOUT, "env": GIVEN_ENV, "self": SELF_ENV, "wenv": WORKDIR_ENV, "begin": probes.GIVEN_BEGIN, "end": probes.GIVEN_END, "hccn": HCCN_CONF,
       "ni": NOT_INSTALLED, "run": RUN_VAR, "runlen": len(RUN_VAR) + 1, "mark": probes.MARK, "rundir": DIR_VAR,
       "chars": sh.ENV_VALUE_CHARS}


def given(plan, host: Host) -> tuple[str, ...]:
    """The sections of this host's probe that its test's python3 prints instead of the sh
    (GIVEN_PY), in the probe's order: the clock's, and those of PYTHON_DOES the plan's checks put into it;
    prepare's only when it reads the arch alone; ver:python's only for the python3 the test is (the
    job's interpreter, no tool environment). () where no test runs python3 (tests_by_python)."""
    if not tests_by_python(plan, host):
        return ()
    from . import devices, disk, nic, stale, user, versions, workdir  # lazy: those check modules import this package's first
    out = []
    for check, probe in (("user", user.USER), ("stale", stale.STALE), ("devices", devices.ASCEND),
                         ("versions", versions.VERSIONS), ("workdir", workdir.WORKDIR), ("disk", disk.DF),
                         ("nic", nic.NIC)):
        if check in plan.checks:
            out += [n for n, b in probe.shell(plan, host) if n in PYTHON_DOES
                    and (n != "ver:python" or b == versions.python_version(PY[0]))]   # not another interpreter
    if probe_section(plan) == [("prepare", prepare_script(plan.cluster, read=("arch",)))]:
        out.append("prepare")
    # the frame's first clock (every probe's); its last stays the sh's `date`, at the probe's end:
    # the two stamps bracket the probe (the skew across hosts is read from their midpoint)
    return ("clock0", *out)


def connect_program(facts: bool, listing: bool, hold: bool = False, given_first: bool = False) -> str:
    """The test's program: orch check's (CONNECT_PY); in `orch up` it prints prepare's facts first
    (supervisor.FACTS_PY) and, once it has tested, lists the sync (lists_sync: sync's listing
    without a python3 start of its own); `hold`: then it waits to be the host's supervisor (HOLD_PY);
    `given_first`: before anything, the sections it gives the sh (GIVEN_PY)."""
    return (GIVEN_PY if given_first else "") + (FACTS_PY if facts else PYTHON_PY) + "sys.stdout.flush()\n" \
        + _CONNECT + (_LIST_AFTER if listing else "") + (HOLD_PY if hold else "") + _QUIT


# the program's end: its output flushed, then no interpreter teardown (its modules, the GC, ~1.3 ms
# of CPU on a lab host with what it imports; the holder it may have forked ends by os._exit too)
_QUIT = "import os,sys\nsys.stdout.flush();sys.stderr.flush();os._exit(0)\n"


CONNECT_PY = connect_program(False, False)   # orch check's

# The test's program is ~12 KB of python in `orch up` (given, facts, the test, the listing, the
# hold): compiling it took a lab host 4.6 ms of CPU on every probe, python3 -S's whole start 6.4.
# Where this orch's agent package is on the host (supervisor.agent_home: a directory of the
# user's, made by the first start there), the program's code object is kept beside the package,
# marshaled, one file a program and Python bytecode (probe-KEY.CACHE_TAG-MAGIC), and loaded
# instead; elsewhere it is compiled as before, and kept where the directory is there. Read only
# from a directory of the user's that no one else may write (not a link), a regular file of the
# user's that no one else may write (not a link, never blocking on a FIFO), and only a code
# object; written beside it (a temporary name no one can guess, O_EXCL, then renamed), all by
# the directory's descriptor. KEY is the program's sha256: another program is another file.
CACHE_ENV = "ORCH_PROBE_CACHE"
CACHED_PY = r"""def _orch_code(s,k):
 import os,sys,marshal
 h=os.environ.pop("ORCH_PROBE_CACHE","");t=getattr(sys.implementation,"cache_tag",None)
 m=getattr(sys.modules.get("_frozen_importlib_external"),"MAGIC_NUMBER",None)
 d=None;f="probe-%s.%s-%s"%(k,t,m.hex() if isinstance(m,bytes) else "")
 if h and t and isinstance(m,bytes):
  try:
   d=os.open(h,os.O_RDONLY|os.O_DIRECTORY|os.O_NOFOLLOW);st=os.fstat(d)
   if st.st_uid!=os.geteuid() or st.st_mode&0o022:os.close(d);d=None
  except OSError:d=None
 if d is not None:
  try:
   x=os.open(f,os.O_RDONLY|os.O_NOFOLLOW|os.O_NONBLOCK,dir_fd=d)
   with open(x,"rb") as y:
    st=os.fstat(x)
    if st.st_mode&0o170000==0o100000 and st.st_uid==os.geteuid() and not st.st_mode&0o022:
     c=marshal.load(y)
     if type(c) is type(_orch_code.__code__):os.close(d);return c
  except (OSError,ValueError,EOFError,TypeError):pass
 c=compile(s,"<orch probe>","exec")
 if d is not None:
  n="%s.%s.tmp"%(f,os.urandom(6).hex())
  try:
   w=os.open(n,os.O_WRONLY|os.O_CREAT|os.O_EXCL|os.O_NOFOLLOW,0o600,dir_fd=d)
   try:
    try:
     b=marshal.dumps(c)
     if os.write(w,b)!=len(b):raise OSError("a short write")
    finally:os.close(w)
    os.rename(n,f,src_dir_fd=d,dst_dir_fd=d)
   except (OSError,ValueError):
    try:os.unlink(n,dir_fd=d)
    except OSError:pass
  except OSError:pass
  os.close(d)
 return c
"""


def cached(program: str) -> str:
    """`program` run as `python3 -S -c` runs it, from its code object kept on the host where one
    is (CACHED_PY; CACHE_ENV names the directory)."""
    key = hashlib.sha256(program.encode()).hexdigest()[:32]
    return CACHED_PY + f"exec(_orch_code({program!r},{key!r}))\n"


# The launch host's global IPv4 addresses, in `ip`'s order (no `ip`: the kernel's own table).
ADDRS_SH = ("if command -v ip >/dev/null 2>&1; then\n"
            "ip -o -4 addr show scope global 2>/dev/null | awk '{split($4, p, \"/\"); print \"addr \" p[1]}'\n"
            "elif [ -r /proc/net/fib_trie ]; then\n"
            "awk '/\\|--/ {a=$2} /\\/32 host LOCAL/ && a !~ /^(127\\.|169\\.254\\.)/ {print \"addr \" a}' "
            "/proc/net/fib_trie\n"
            "fi | awk '!s[$0]++'")


def connect_timeout(plan) -> int:
    return max(1, round(plan.cluster.ssh.connect_timeout))


def _others(plan) -> list[Host]:
    return [h for h in plan.hosts if h.name != plan.launch.name]


def _applies(plan, host: Host) -> bool:
    return len(plan.hosts) > 1


def reach_cap(plan) -> float:
    """How long the listener may live: one host's connect (ssh.connect_timeout x retries and
    their back-off), its test (2 x connect_timeout) and slack, and 10 s for each further round of
    the fan-out (more hosts than ssh.fanout); at most MAX_CAP. It goes as soon as every host came."""
    ssh = plan.cluster.ssh
    rounds = math.ceil(len(_others(plan)) / max(1, ssh.fanout))
    one = ssh.connect_timeout * ssh.retries + 2.0 * ssh.retries + 2 * connect_timeout(plan) + 10
    return min(MAX_CAP, one + 10.0 * max(0, rounds - 1))


def relay_wait(plan) -> float:
    """How long the other hosts' probes wait for the launch host's listener: its connect (with
    retries and their back-off) and its probe's start."""
    ssh = plan.cluster.ssh
    return ssh.connect_timeout * ssh.retries + 2.0 * ssh.retries + 10


def tokens(plan) -> tuple[str, str]:
    """(what the hosts present, what the listener answers): the check's random token, halved."""
    t = plan.reach_token
    return t[:len(t) // 2], t[len(t) // 2:]


def listen_body(plan) -> str:
    """The launch host's section: its addresses, job.interface there (when set), then the
    listener's port (`listen PORT`) or why there is none (`nolisten WHY`)."""
    q = shlex.quote
    tin, tout = tokens(plan)
    parts = [f"orch_reach_addrs=$({ADDRS_SH})", 'printf \'%s\\n\' "$orch_reach_addrs"']
    if plan.cluster.job.interface:
        parts.append(probes.interface_script(plan.cluster.job.interface, plan.launch.cluster_address))
    args = " ".join(q(str(a)) for a in (len(_others(plan)), f"{reach_cap(plan):g}", f"{GRACE:g}", f"{PEER_TIMEOUT:g}",
                                         READ_LIMIT, plan.launch.cluster_address))
    parts.append(f"p=$(printf '%s\\n' \"$orch_reach_addrs\" | {ENV_IN}={q(tin)} {ENV_OUT}={q(tout)} $T "
                 f"{' '.join(PY)} -c {q(LISTEN_PY)} {args} 2>&1) "
                 "&& [ -n \"$p\" ] || { printf 'nolisten %s\\n' "
                 "\"$(printf '%s' \"$p\" | tr '\\n' ' ' | cut -c1-300)\"; exit 1; }\necho \"listen $p\"")
    return "\n".join(parts)


def connect_body(plan, host: Host) -> str:
    """Another host's section: its test against plan.reach (or why there is none)."""
    q = shlex.quote
    target = plan.reach
    if target is None:
        target = ReachTarget(untested="not tested: the launch host's listener is known only while `orch check` runs")
    if not target.port:
        return f"echo {q('untested ' + target.status + ' ' + target.untested)}"
    tin, tout = tokens(plan)
    index = next(i for i, h in enumerate(plan.hosts) if h.name == host.name)
    args = " ".join(q(str(a)) for a in (index, target.port, connect_timeout(plan), *target.addresses))
    facts = probe_facts(plan)
    listing = lists_sync(plan, host)
    hold = holds(plan, host)
    gives = given(plan, host)
    env = sh.assignments({**facts, **({LIST_ENV: plan.cluster.job.workdir} if listing else {}), ENV_IN: tin,
                          ENV_OUT: tout, **({GIVEN_ENV: " ".join(gives)} if gives else {}),
                          **({WORKDIR_ENV: plan.cluster.job.workdir} if {"workdir", "df"} & set(gives) else {}),
                          CACHE_ENV: agent_home(plan.cluster)})
    if gives:   # the probe's shell, for stale's `self` as the sh's section prints it
        env += f" {SELF_ENV}=$$"
    if hold:   # the seconds it waits, and the names it drops from its environment once it is the supervisor
        env += " " + sh.assignments({**run_env(plan.run_id), HOLD_ENV: " ".join(
            [f"{plan.hold:g}", *facts, *([LIST_ENV] if listing else []), ENV_IN, ENV_OUT]
        )})
    # run in the probe's own shell (a lead section: no `exit`); GIVEN_VAR set: the program ran
    return (f"if command -v {PY[0]} >/dev/null 2>&1; then {probes.GIVEN_VAR}=1\n"
            f"{env} {' '.join(PY)} -c {q(cached(connect_program(bool(facts), listing, hold, bool(gives))))} {args} 2>&1"
            + (f" {list_heredoc(plan.listing)}" if listing else "") + f"\nelse echo {NOT_INSTALLED}; fi")


def tests_by_python(plan, host: Host) -> bool:
    """Does this host's reach section run the test (connect_program: python3, which also prints
    the supervisor's version for check path, and in `orch up` the workdir's lock and the agent
    package for prepare, and lists the sync: lists_sync)? Only with the launch host's listener
    known (plan.reach)."""
    return (SECTION in plan.checks and _applies(plan, host) and host.name != plan.launch.name
            and plan.reach is not None and bool(plan.reach.port))


def holds(plan, host: Host) -> bool:
    """Does this host's reach test stay to be its supervisor (HOLD_PY; plan.hold)? Its probe's
    shell then gives it the session's stdin and stdout (probes.assemble's `hold`). Not on a
    `connection: local` host: its commands run as subprocesses of orch, with no session to hold."""
    return plan.hold > 0 and host.connection != "local" and tests_by_python(plan, host)


def held(sections) -> bool:
    """Did the host's reach test say it holds the session (HELD)?"""
    sec = None if sections is None else sections.get(SECTION)
    return sec is not None and HELD in sec.body.split("\n")


def lists_sync(plan, host: Host) -> bool:
    """Does this host's reach test list the sync too (`orch up`, the test's python3 runs:
    tests_by_python)? Then its section carries the listing and the probe has no synclist section."""
    return bool(plan.listing) and tests_by_python(plan, host)


def supervisor_version(sections) -> str | None:
    """The supervisor's python3 version as a host's reach test printed it (tests_by_python), read
    as supervisor.parse_python reads python_sh's: "X.Y"; "" when python3 did not run there (not
    installed, or it failed at its start: python_sh's own fallback); None when the section says
    nothing of it (no test ran there: untested, the launch host; or the section did not run)."""
    sec = None if sections is None else sections.get(SECTION)
    if sec is None or not sec.finished:
        return None
    got = parse_python(sec.body)
    if got is not None or sec.body.startswith(("untested ", "orch: not run")):
        return got
    return "" if sec.rc != 0 or NOT_INSTALLED in sec.body.split() else None


def _listen_shell(plan, host: Host) -> list[tuple[str, str]]:
    return [(SECTION, listen_body(plan))] if _applies(plan, host) and host.name == plan.launch.name else []


def _test_shell(plan, host: Host) -> list[tuple[str, str]]:
    return [(SECTION, connect_body(plan, host))] if _applies(plan, host) and host.name != plan.launch.name else []


# the listener first thing on the launch host (the others' probes wait for its port); the test
# first on the others, in the probe's own shell (a lead section): its output goes out as it comes.
# In the background it overlapped their other sections (~20 ms), and cost a temporary file
# (mktemp, cat, rm twice); with the clock, df and nic given too, 37.9 -> 18.9 ms of CPU a probe on a lab host
LISTEN = Probe("reach-listen", _listen_shell)
TEST = Probe("reach-test", _test_shell, place="lead")


# --------------------------------------------------------------------------- from the listener to the hosts


def head_for(plan, listen: Listen | None = None) -> HeadReach:
    """Where the run will have the other hosts reach the launch host (launchers.head_reach),
    job.interface's address as the launch host's probe read it."""
    iface = listen.interface.address if listen is not None and listen.interface is not None else None
    return head_reach(plan.cluster, plan.launch, plan.hosts, iface or None)


def target_for(plan, listen: Listen, now: float) -> ReachTarget:
    """The launch host's listener -> what the other hosts test: the address the run uses first,
    then the launch host's other global IPv4 addresses (even when pinned: a hint; not when every
    host is this machine)."""
    if listen.port is None:
        return ReachTarget(untested=f"not tested: the launch host {plan.launch.name} could not open the test's "
                                    f"listener: {listen.error}")
    head = head_for(plan, listen)
    # every host is this machine: its other addresses are no news (and no traffic leaves it)
    addrs = head.addresses if head.why == "local" else tuple(dict.fromkeys((*head.addresses, *listen.addresses)))
    return ReachTarget(listen.port, addrs, now + reach_cap(plan) - (2 * connect_timeout(plan) + 5))


class Relay:
    """The launch host's listener, from its probe's output as it comes (feed), to the other hosts'
    probes (plan_for: each waits for it, at most `wait` seconds). Resolved once: by the listen
    section, or by the launch host's probe ending without one (done)."""

    def __init__(self, plan, wait: float):
        self.plan, self.wait = plan, wait
        self.ready = threading.Event()
        self.target: ReachTarget | None = None
        self._lock = threading.Lock()

    @classmethod
    def of(cls, plan) -> Relay | None:
        """None when no host tests (check skipped, one host)."""
        if SECTION not in plan.checks or not _applies(plan, plan.launch):
            return None
        return cls(plan, relay_wait(plan))

    def resolve(self, target: ReachTarget) -> None:
        with self._lock:
            if not self.ready.is_set():
                self.target = target
                self.ready.set()

    def feed(self, text: str) -> bool:
        """The launch host's output so far; True once the listener is known."""
        sec = probes.split_sections(text).get(SECTION) if f"{probes.MARK}end {SECTION} " in text else None
        if sec is None or not sec.finished:
            return self.ready.is_set()
        try:
            listen = probes.parse_listen(sec.body)
        except probes.ProbeError as exc:
            listen = Listen(None, (), None, str(exc))
        self.resolve(target_for(self.plan, listen, time.monotonic()))
        return True

    def done(self, why: str) -> None:
        """The launch host's probe ended (or never ran): what no listener means now."""
        self.resolve(ReachTarget(untested=f"not tested: {why}"))

    def plan_for(self, host: Host):
        """The check plan a host's probe is made from: with the listener (or why there is none)."""
        self.ready.wait(self.wait)
        t = self.target if self.ready.is_set() and self.target is not None else ReachTarget(
            untested=f"not tested: the launch host {self.plan.launch.name}'s listener was not up within "
                     f"{self.wait:g}s")
        if t.port and time.monotonic() > t.until:
            t = ReachTarget(untested=f"not tested: this host's probe started after the launch host's listener "
                                     f"had closed ({reach_cap(self.plan):g}s)", status="warn")
        return replace(self.plan, reach=t)

    # forked fan-out processes (shards) get it as bytes
    def encode(self) -> bytes:
        self.ready.wait(self.wait)
        t = self.target or ReachTarget()
        import json

        return json.dumps([t.port, list(t.addresses), t.until, t.untested, t.status]).encode()

    def decode(self, data: bytes) -> None:
        import json

        try:
            port, addrs, until, untested, status = json.loads(data)
            self.resolve(ReachTarget(int(port), tuple(addrs), float(until), str(untested),
                                     "warn" if status == "warn" else "error"))
        except (ValueError, TypeError):
            self.done("the fan-out process did not get the launch host's listener")


# --------------------------------------------------------------------------- judging


def judge_listen(plan, host: Host, sec: Section) -> CheckResult:
    """The launch host: did its listener open?"""
    listen = probes.parse_listen(sec.body)
    if listen.port is None:
        return result(SECTION, host, "error", f"not checked: could not open the test's listener: {listen.error}")
    n = len(_others(plan))
    # (no port in the message: it changes with every check, the report would never repeat)
    return result(SECTION, host, "pass", f"opened the test's TCP listener for the other {n} host(s)")


def _tried(pairs) -> str:
    return "; ".join(f"{a}: {why}" for a, why in pairs)


def judge_reach(plan, host: Host, sec: Section) -> CheckResult:
    """Another host: does it reach the launch host by TCP at the address the run uses (pass)?
    Unpinned, at another of its addresses (warn: the run works, the cluster address is no good
    from here; mpi_address pins the one that is)? Else (fail): which were tried, how each failed,
    the fix."""
    got = probes.parse_reach(sec.body)
    launch = plan.launch.name
    if got is None:
        return result(SECTION, host, "error", f"not checked: no python3 on this host to test TCP to {launch} with")
    if got.untested:
        return result(SECTION, host, got.status, got.untested)
    head = head_for(plan)
    ok = [a for a, why in got.tried if why == "ok"]
    first, first_why = got.tried[0]
    where = {"mpi_address": "its mpi_address", "interface": "its address on job.interface",
             "local": "this machine", "single": "its address"}.get(head.why, "its cluster address")
    if first_why == "ok":
        return result(SECTION, host, "pass", f"reaches the launch host {launch} by TCP at {first} ({where})")
    if ok and not head.pinned:  # the run works (its supervisors find it): a warning, so that the table says so
        return result(SECTION, host, "warn",
                      f"reaches the launch host {launch} by TCP at {ok[0]}, not at {first} ({where}: {first_why}): the "
                      f"run's supervisors and MASTER_ADDR use the address that answers, hostfiles and rank tables "
                      f"still name {first}; `mpi_address: {ok[0]}` on {launch} makes them all use it"
                      + (f". With mpirun, Open MPI's own TCP traffic between the ranks can hang trying {first}: "
                         f"pin it to the hosts' network, `mpirun_args: [-mca, btl_tcp_if_include, <its CIDR, as "
                         f"{ok[0]}/24>]`, or set job.interface" if plan.cluster.job.launcher == "mpirun" else ""))
    others = got.tried[1:]
    msg = (f"cannot reach the launch host {launch} by TCP at {first} ({where}): {first_why}"
           + (f" (tried too: {_tried(others)})" if others and not ok else ""))
    if ok:
        fix = (f"it does reach {launch} at {', '.join(ok)}: set `mpi_address: {ok[0]}` on {launch} in the "
               f"inventory" + (" (or job.interface to the NIC that carries it)" if head.why == "interface" else ""))
    elif head.pinned:
        fix = (f"nor at {launch}'s other addresses: fix {where} (`mpi_address` on {launch}, job.interface) or the "
               f"network between the hosts (routes, firewall: TCP from the hosts to {launch})")
    else:
        fix = (f"set `mpi_address: <an address of {launch} the hosts reach>` on {launch} in the inventory, or "
               f"`job.interface: <{launch}'s NIC on the hosts' network>`; or open TCP from the hosts to {launch} "
               "(routes, firewall)")
    return result(SECTION, host, "fail", f"{msg}; {fix}")


def _judge(plan, run) -> list[CheckResult]:
    sec = section(run.sections, SECTION)
    if run.host.name == plan.launch.name:
        return [judge_listen(plan, run.host, sec)]
    return [judge_reach(plan, run.host, sec)]


register(Check(SECTION, applies=_applies, probes=(LISTEN, TEST), judge=_judge))
