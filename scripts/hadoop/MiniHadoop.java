import java.io.File;
import java.io.FileOutputStream;
import java.io.OutputStream;
import java.nio.charset.StandardCharsets;

import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.FileSystem;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.fs.permission.FsPermission;
import org.apache.hadoop.hdfs.MiniDFSCluster;
import org.apache.hadoop.yarn.conf.YarnConfiguration;
import org.apache.hadoop.yarn.server.MiniYARNCluster;
import org.apache.hadoop.yarn.util.resource.ResourceUtils;

/**
 * A MiniDFSCluster (one NameNode, one DataNode) and a MiniYARNCluster (a ResourceManager and
 * NODE_MANAGERS NodeManagers) in this JVM, for sparktrain's tests:
 *
 *   java -cp JARS:CLASSES MiniHadoop WORKDIR NODE_MANAGERS NM_MEMORY_MB NM_VCORES [NM_GPUS]
 *
 * With NM_GPUS > 0, GPUs are a resource type (yarn.io/gpu, scheduled by the
 * DominantResourceCalculator) and each NodeManager offers NM_GPUS of them, declared in its
 * configuration as Hadoop's own resource-type tests do (no devices: YARN counts, it does not
 * isolate; Spark's discovery script announces the container's addresses).
 * writes WORKDIR/conf/{core,hdfs,yarn}-site.xml (the HADOOP_CONF_DIR clients use), prints
 * "READY hdfs://127.0.0.1:PORT" and runs until its standard input closes. A file
 * WORKDIR/control/stop-nm-I stops NodeManager I for good (a machine lost, as a test's fault):
 * the file is renamed to stop-nm-I.done once the NodeManager has stopped.
 */
public final class MiniHadoop {
  private static final String GPU = "yarn.io/gpu";

  public static void main(String[] args) throws Exception {
    File work = new File(args[0]).getAbsoluteFile();
    int nodeManagers = Integer.parseInt(args[1]);
    int memory = Integer.parseInt(args[2]);
    int vcores = Integer.parseInt(args[3]);
    int gpus = args.length > 4 ? Integer.parseInt(args[4]) : 0;
    File confDir = new File(work, "conf");
    confDir.mkdirs();

    Configuration conf = new Configuration();
    conf.set(MiniDFSCluster.HDFS_MINIDFS_BASEDIR, new File(work, "dfs").getPath());
    conf.set("dfs.permissions.enabled", "false");
    MiniDFSCluster dfs = new MiniDFSCluster.Builder(conf).numDataNodes(1).build();
    dfs.waitActive();
    String fsUri = dfs.getFileSystem().getUri().toString();
    FileSystem fs = dfs.getFileSystem();
    fs.mkdirs(new Path("/user/" + System.getProperty("user.name")));
    fs.mkdirs(new Path("/tmp"), new FsPermission((short) 01777));

    YarnConfiguration yarn = new YarnConfiguration(conf);
    yarn.set("fs.defaultFS", fsUri);
    yarn.setInt("yarn.nodemanager.resource.memory-mb", memory);
    yarn.setInt("yarn.nodemanager.resource.cpu-vcores", vcores);
    yarn.setInt("yarn.scheduler.minimum-allocation-mb", 64);
    yarn.setInt("yarn.scheduler.maximum-allocation-mb", memory);
    yarn.setInt("yarn.scheduler.maximum-allocation-vcores", vcores);
    yarn.setBoolean("yarn.nodemanager.vmem-check-enabled", false);
    yarn.setBoolean("yarn.nodemanager.pmem-check-enabled", false);
    yarn.set("yarn.nodemanager.disk-health-checker.max-disk-utilization-per-disk-percentage",
             "100.0");
    yarn.set("yarn.scheduler.capacity.root.queues", "default");
    yarn.set("yarn.scheduler.capacity.root.default.capacity", "100");
    yarn.set("yarn.scheduler.capacity.root.default.maximum-capacity", "100");
    yarn.set("yarn.scheduler.capacity.maximum-am-resource-percent", "1.0");
    yarn.setInt("yarn.nodemanager.delete.debug-delay-sec", 600);  // container logs kept
    yarn.set("yarn.log-aggregation-enable", "false");
    if (gpus > 0) {
      yarn.set("yarn.resource-types", GPU);
      yarn.setInt("yarn.nodemanager.resource-type." + GPU, gpus);
      yarn.set("yarn.scheduler.capacity.resource-calculator",
               "org.apache.hadoop.yarn.util.resource.DominantResourceCalculator");
      ResourceUtils.resetResourceTypes(yarn);
    }
    MiniYARNCluster cluster = new MiniYARNCluster("sparktrain", nodeManagers, 1, 1);
    cluster.init(yarn);
    cluster.start();
    Configuration started = cluster.getConfig();
    // the ResourceManager's real port reaches the configuration shortly after start()
    long deadline = System.currentTimeMillis() + 60_000;
    while (started.get(YarnConfiguration.RM_ADDRESS, "").endsWith(":0")
           && System.currentTimeMillis() < deadline) {
      Thread.sleep(100);
    }
    // what clients need, without the test settings the clusters set for themselves
    Configuration core = new Configuration(false);
    core.set("fs.defaultFS", fsUri);
    write(core, new File(confDir, "core-site.xml"));
    Configuration client = new Configuration(false);
    for (java.util.Map.Entry<String, String> entry : started) {
      String key = entry.getKey();
      if (key.startsWith("yarn.resourcemanager.") && key.contains("address")) {
        client.set(key, started.get(key));
      }
    }
    client.set("yarn.resourcemanager.scheduler.class",
               started.get("yarn.resourcemanager.scheduler.class"));
    if (gpus > 0) {  // a client asks for a resource only of a type it knows
      client.set("yarn.resource-types", GPU);
    }
    write(client, new File(confDir, "yarn-site.xml"));
    write(new Configuration(false), new File(confDir, "hdfs-site.xml"));
    File control = new File(work, "control");
    control.mkdirs();
    System.out.println("READY " + fsUri);
    System.out.flush();
    Thread parent = new Thread(() -> {
      try {
        while (System.in.read() >= 0) {
          // runs until the parent closes our standard input (or dies)
        }
      } catch (java.io.IOException e) {
        // the same as a closed input
      }
    });
    parent.setDaemon(true);
    parent.start();
    while (parent.isAlive()) {
      parent.join(200);
      for (int i = 0; i < nodeManagers; i++) {
        File stop = new File(control, "stop-nm-" + i);
        if (stop.exists()) {
          System.out.println("STOPPING NodeManager " + i);
          cluster.getNodeManager(i).stop();
          stop.renameTo(new File(control, "stop-nm-" + i + ".done"));
          System.out.println("STOPPED NodeManager " + i);
          System.out.flush();
        }
      }
    }
    cluster.stop();
    dfs.shutdown();
  }

  private static void write(Configuration conf, File file) throws Exception {
    try (OutputStream out = new FileOutputStream(file)) {
      conf.writeXml(out);
    }
  }
}
